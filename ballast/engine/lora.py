"""LoRA adapters on an engine's model (PEFT), and the name and merge maps that weight sync and export use.

`attach_adapter` injects PEFT LoRA layers (PEFT's own, with a fused forward: `fused_linear_class`)
into the Hugging Face model in place, before `parallelize`
applies FSDP2 or DDP, so the adapter is sharded, replicated and gradient-summed exactly like the full
model's parameters would be; the base weights are frozen (`requires_grad=False`), so the optimizer,
gradient clipping and the checkpoint's optimizer state hold adapter parameters only. The engine keeps
forwarding through the Hugging Face module itself: PEFT's wrapper object is kept only for its config
and to switch the adapter off (the reference policy of a LoRA run is the actor without its adapter).

A critic's value head is freshly initialised, so it is trained whole next to the adapter (PEFT's
`modules_to_save`) and never gets LoRA layers of its own.

Names. Inside the model, PEFT renames a wrapped linear layer `X`'s weight to `X.base_layer.weight` and
adds `X.lora_A.default.weight` (r, in) and `X.lora_B.default.weight` (out, r); a head trained whole
becomes `H.modules_to_save.default.*` next to its frozen `H.original_module.*`. Three views of that
state are needed, each a stream of (name, full tensor) pairs in state-dict order:

* `merged_state`: Hugging Face names, each wrapped weight replaced by `W + (alpha / r) B A` (merged
  weight sync, HF export);
* `base_state`: Hugging Face names of the frozen base model (refilling a rollout engine that lost its
  weights while the adapter is served separately);
* `adapter_state`: the adapter alone under PEFT's file names (`base_model.model.X.lora_A.weight`), what
  `adapter_model.safetensors` holds and what vLLM's LoRA loader reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ballast.engine.config import LoraSpec, SpecError
from ballast.engine.safe_load import check_adapter_weights

ADAPTER_NAME = "default"
PEFT_PREFIX = "base_model.model."
ADAPTER_DIR = "lora_adapter"  # the adapter's folder inside an exported model directory
# Attribute names of a token-classification model's value head (transformers' conventions).
VALUE_HEAD_NAMES = ("score", "classifier")
_FUSED: type | None = None  # fused_linear_class(), made once
_WRAPPED = re.compile(r"^(?P<module>.+)\.(?P<part>base_layer\.weight|lora_A\.default\.weight|lora_B\.default\.weight)$")


@dataclass
class Adapter:
    """What `attach_adapter` leaves on the engine: the PEFT wrapper (config and on/off switch), the
    scaling of every adapted module (by its name in the Hugging Face model), and the value head trained
    whole (critics), if any."""

    peft_model: torch.nn.Module
    scalings: dict[str, float]
    head: str | None

    @property
    def config(self):
        return self.peft_model.peft_config[ADAPTER_NAME]

    def config_dict(self) -> dict:
        """The adapter's `adapter_config.json` content (plain JSON types)."""
        return json.loads(json.dumps(self.config.to_dict(), default=_jsonable))

    @property
    def max_rank(self) -> int:
        """The largest LoRA rank of any adapted module (an adapter loaded from disk may use patterns)."""
        cfg = self.config
        return max([int(cfg.r), *(int(r) for r in (cfg.rank_pattern or {}).values())])

    def record(self) -> dict:
        """What a checkpoint records about the adapter; a resume must find the same."""
        return {"r": int(self.config.r), "lora_alpha": float(self.config.lora_alpha), "modules": sorted(self.scalings)}

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Forward passes inside run the base model (PEFT skips every LoRA layer). Local: no collective."""
        layers = self.peft_model.base_model
        layers.disable_adapter_layers()
        try:
            yield
        finally:
            layers.enable_adapter_layers()


def _jsonable(value):
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "value"):  # enums (peft_type, task_type)
        return value.value
    raise TypeError(f"cannot write {value!r} to adapter_config.json")


def value_head_name(model: torch.nn.Module) -> str:
    for name in VALUE_HEAD_NAMES:
        if isinstance(getattr(model, name, None), torch.nn.Linear):
            return name
    raise ValueError(f"{type(model).__name__} has no value head named {' or '.join(VALUE_HEAD_NAMES)}")


def fused_linear_class() -> type:
    """PEFT's LoRA `Linear` with a forward that adds the adapter inside one GEMM.

    PEFT computes `base(x) + lora_B(lora_A(x)) * scaling`: the adapter's (tokens x out) output is
    written, scaled into a second tensor and added into a third, and backward walks those passes again.
    On CPU these memory-bound passes over every projection's output cost as much as a third of the
    frozen model's update. Here the scaling goes on the (tokens x rank) product and the result is
    `addmm(base(x), scaling * lora_A(x), B^T)`: one GEMM writes the sum. Same parameters, names and
    state dict as PEFT's layer (a subclass, registered for `nn.Linear` targets); anything but plain
    single-adapter LoRA (dropout, DoRA and other variants, adapter biases, mixed batches, merged or
    switched-off adapters) takes PEFT's own forward.
    """
    global _FUSED
    if _FUSED is None:
        from peft.tuners.lora.layer import Linear

        class FusedLoraLinear(Linear):
            def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
                names = self.active_adapters
                name = names[0] if len(names) == 1 else None
                if (args or kwargs or name is None or self.disable_adapters or self.merged or name not in self.lora_A
                        or name in self.lora_variant or not isinstance(self.lora_dropout[name], torch.nn.Identity)
                        or self.lora_B[name].bias is not None):
                    return super().forward(x, *args, **kwargs)
                out = self.base_layer(x)
                lora_a, lora_b = self.lora_A[name], self.lora_B[name]
                h = lora_a(x.to(lora_a.weight.dtype)) * self.scaling[name]
                flat = torch.addmm(out.reshape(-1, out.shape[-1]), h.reshape(-1, h.shape[-1]).to(out.dtype),
                                   lora_b.weight.t().to(out.dtype))
                return flat.view(out.shape)

        _FUSED = FusedLoraLinear
    return _FUSED


def use_fused_linear(config):
    """Make PEFT build `fused_linear_class()` layers for the `nn.Linear` targets of `config`."""
    config._register_custom_module({torch.nn.Linear: fused_linear_class()})
    return config


def _lora_config(spec: LoraSpec, role: str, head: str | None):
    from peft import LoraConfig

    def listed(value):
        return list(value) if isinstance(value, tuple) else value

    exclude = listed(spec.exclude_modules)
    if head is not None:  # the value head is trained whole, never adapted
        exclude = [*([exclude] if isinstance(exclude, str) else exclude or []), head]
    return use_fused_linear(LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=listed(spec.target_modules),
                                       exclude_modules=exclude, lora_dropout=0.0, bias="none",
                                       task_type="TOKEN_CLS" if role == "critic" else "CAUSAL_LM",
                                       modules_to_save=[head] if head is not None else None))


def attach_adapter(model: torch.nn.Module, spec: LoraSpec, role: str, seed: int = 0) -> Adapter:
    """Inject the LoRA adapter `spec` describes into `model` (in place) and freeze everything else.

    `seed` fixes the random init of the A matrices, so every rank builds the same adapter before FSDP2
    shards it (FSDP2 broadcasts nothing). Raises ValueError when the targets select anything but
    linear layers (embeddings, convolutions): merged sync and vLLM serve linear LoRA only.
    """
    from peft import PeftModel, get_peft_model

    if not spec.enabled:
        raise ValueError("attach_adapter needs a LoraSpec with rank > 0 or an adapter_path")
    head = value_head_name(model) if role == "critic" else None
    config = _peft_config(spec, role, head)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if spec.adapter_path is not None:
            check_adapter_weights(spec.adapter_path)  # a refused file is named, not torch's generic message
            peft_model = PeftModel.from_pretrained(model, spec.adapter_path, config=config, is_trainable=True)
        else:
            peft_model = get_peft_model(model, config)
    adapter = Adapter(peft_model, _scalings(model), head)
    if head is not None and not any(head in n and p.requires_grad for n, p in model.named_parameters()):
        raise ValueError(f"the critic's adapter does not train its value head {head!r}: an adapter loaded "
                         f"from {spec.adapter_path!r} must list it in modules_to_save")
    return adapter


def check_targets(model_path: str, spec: LoraSpec, role: str, trust_remote_code: bool = False) -> None:
    """What `attach_adapter` would refuse about `spec` on the model in `model_path` (targets that match
    no module, or a module that is not a linear layer), found on a weightless copy of the model (meta
    device) in about a second, before any worker starts. `SpecError` naming `target_modules`, or
    `adapter_path` for an adapter loaded from disk (its own config names the targets)."""
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        if role == "critic":
            config.num_labels = 1
            model = AutoModelForTokenClassification.from_config(config, trust_remote_code=trust_remote_code)
        else:
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    try:
        get_peft_model(model, _peft_config(spec, role, value_head_name(model) if role == "critic" else None))
        _scalings(model)
    except ValueError as err:
        field = "adapter_path" if spec.adapter_path is not None else "target_modules"
        raise SpecError(field, f"{err} (in the modules of {model_path!r})") from None


def _peft_config(spec: LoraSpec, role: str, head: str | None):
    """PEFT's config of the adapter: the saved one of `spec.adapter_path`, else one made from `spec`."""
    if spec.adapter_path is not None:
        from peft import PeftConfig

        return use_fused_linear(PeftConfig.from_pretrained(spec.adapter_path))
    return _lora_config(spec, role, head)


def _scalings(model: torch.nn.Module) -> dict[str, float]:
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import Linear as LoraLinear

    scalings = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if not isinstance(module, LoraLinear):
            raise ValueError(f"LoRA target {name!r} is a {type(module.get_base_layer()).__name__}, not a linear "
                             "layer: Ballast merges and serves linear LoRA only (narrow target_modules)")
        scalings[name] = float(module.scaling[ADAPTER_NAME])
    if not scalings:
        raise ValueError("the LoRA adapter adapts no module (check target_modules / exclude_modules)")
    return scalings


# ---------------------------------------------------------------------------------------- names
def is_adapter_param(name: str) -> bool:
    """Whether state-dict entry `name` belongs to the adapter (LoRA A/B or a head trained whole)."""
    return f".lora_A.{ADAPTER_NAME}." in name or f".lora_B.{ADAPTER_NAME}." in name or (
        f".modules_to_save.{ADAPTER_NAME}." in name)


def peft_name(name: str) -> str:
    """The name PEFT writes to `adapter_model.safetensors` for model state-dict entry `name`."""
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.{ADAPTER_NAME}.", f".{part}.")
    return PEFT_PREFIX + name.replace(f".modules_to_save.{ADAPTER_NAME}.", ".")


def adapter_state(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter entries of a (model name, tensor) stream, under PEFT's file names."""
    for name, tensor in named:
        if is_adapter_param(name):
            yield peft_name(name), tensor


def base_state(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The frozen base model of a (model name, tensor) stream, under Hugging Face names."""
    for name, tensor in named:
        if is_adapter_param(name):
            continue
        yield name.replace(".base_layer.", ".").replace(".original_module.", "."), tensor


def merged_state(named: Iterable[tuple[str, torch.Tensor]], scalings: dict[str, float]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face names with every adapted weight merged: W + scaling * B @ A (computed in float32,
    returned in W's dtype). A head trained whole replaces its frozen original. Streams: a module's
    three tensors are held only until the last of them arrives."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        if f".original_module." in name:
            continue
        if f".modules_to_save.{ADAPTER_NAME}." in name:
            yield name.replace(f".modules_to_save.{ADAPTER_NAME}.", "."), tensor
            continue
        match = _WRAPPED.match(name)
        if match is None or match["module"] not in scalings:
            yield name.replace(".base_layer.", "."), tensor
            continue
        parts = pending.setdefault(match["module"], {})
        parts[match["part"].split(".")[0]] = tensor
        if len(parts) == 3:
            module = match["module"]
            del pending[module]
            yield f"{module}.weight", merge_weight(parts["base_layer"], parts["lora_A"], parts["lora_B"],
                                                   scalings[module])
    if pending:
        raise ValueError(f"adapted modules without all of base_layer/lora_A/lora_B in the stream: {sorted(pending)}")


def merge_weight(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    delta = (lora_b.float() @ lora_a.float()) * scaling
    return (base.float() + delta).to(base.dtype)


# ---------------------------------------------------------------------------------------- files
def save_adapter(path: str, full_state: Iterable[tuple[str, torch.Tensor]], adapter: Adapter) -> None:
    """Write a PEFT adapter directory (`adapter_model.safetensors`, `adapter_config.json`) from the full
    (unsharded) model state; `PeftModel.from_pretrained(base, path)` loads it. Call on one rank."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in adapter_state(full_state)}
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter.config_dict(), f, indent=2, sort_keys=True)
