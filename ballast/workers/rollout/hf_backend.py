"""Rollout with transformers `generate`: the fallback without vLLM and a fast backend for tests.

Request-level like every backend: its core (`HFCore`) generates every waiting request in one
left-padded transformers `generate` per step (transformers has no continuous batching). Sampling (temperature, top-k, top-p) is done by our own logits processor instead of transformers'
warpers, for two reasons: transformers applies custom processors *before* its warpers, so a
processor could not see the final distribution; and keeping `output_scores` would hold
steps x batch x vocab floats (tens of GB for a real vocabulary). Our processor keeps only the
last step's distribution and reads off the log-prob of the token that was actually chosen.

`rollout_log_probs` definition (both backends): log-prob of the chosen token under the
distribution it was drawn from, i.e. log_softmax of logits / temperature after top-k and top-p
filtering (renormalised over the kept tokens); for greedy decoding, log_softmax of the raw logits.
With top-k and top-p off this equals the trainer's temperature-scaled log-prob of the token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from .async_engine import TurnOutput, TurnRequest, check_request, derived_seed, finish
from .base import RolloutConfig, SamplingConfig, resolve_special_tokens, stop_ids_for

# Partial rollouts: tokens a request samples between two chances to take new weights.
HF_RESUMABLE_STEP_TOKENS = 16


def apply_sampling_filters(scores: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """logits (B, V) -> logits / temperature with tokens outside top-k / top-p set to -inf.

    Identity (up to a float32 cast) for greedy decoding. Pure; shared by tests.
    """
    scores = scores.float()
    if not sampling.do_sample:
        return scores
    if sampling.temperature != 1.0:
        scores = scores / sampling.temperature
    if sampling.top_k != -1 and sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p; the most likely token always stays.
        drop_sorted = mass_before >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


class _SamplingProcessor(LogitsProcessor):
    """A transformers logits processor: filters as `apply_sampling_filters`, records chosen log-probs."""

    def __init__(self, sampling: SamplingConfig, prompt_width: int, record: bool):
        self.sampling = sampling
        self.prompt_width = prompt_width
        self.record = record
        self._last_log_probs: torch.Tensor | None = None
        self._chosen: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.record and input_ids.shape[1] > self.prompt_width:
            # The previous step's token is now the last input column: read its log-prob.
            self._chosen.append(self._last_log_probs.gather(1, input_ids[:, -1:])[:, 0])
        scores = apply_sampling_filters(scores, self.sampling)
        if self.record:
            self._last_log_probs = torch.log_softmax(scores, dim=-1)
        return scores

    def finish(self, generated: torch.Tensor) -> list[list[float]]:
        """Per-row log-probs of `generated` (B, T), the ids appended by generate."""
        if generated.shape[1] == 0:
            return [[] for _ in range(generated.shape[0])]
        self._chosen.append(self._last_log_probs.gather(1, generated[:, -1:])[:, 0])
        assert len(self._chosen) == generated.shape[1], (len(self._chosen), generated.shape)
        return torch.stack(self._chosen, dim=1).cpu().tolist()


class HFBackend:
    """Rollout backend on a transformers causal LM.

    `model`: an already built module to generate with (e.g. a colocated copy); None loads
    `config.model_path`. No tensor parallelism; sleep/wake_up are no-ops.
    """

    def __init__(self, config: RolloutConfig, model: torch.nn.Module | None = None):
        if config.backend != "hf":
            raise ValueError(f"HFBackend needs config.backend='hf', got {config.backend!r}")
        self.config = config
        self.device = torch.device(config.resolved_device())
        if model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(
                config.model_path, dtype=getattr(torch, config.resolved_dtype()), attn_implementation="sdpa"
            ).to(self.device)
        self.model = model.eval()
        # A model passed in stays where it is; inputs follow it.
        self.device = next(self.model.parameters()).device
        self.eos_token_ids, self.pad_token_id = resolve_special_tokens(config)
        self.vocab_size = int(self.model.config.get_text_config().vocab_size)
        self.max_model_len = config.max_model_len
        self.num_calls = 0
        self._adapter: dict[str, torch.Tensor] | None = None  # PEFT file name -> the served adapter's tensor
        self.adapter_unavailable: str | None = None  # PEFT serves any adapter the actor trains

    def core(self, sampling: SamplingConfig, resumable: bool = False) -> "HFCore":
        """The request-level core of this backend under `sampling` (see `HFCore`); `resumable` slices
        every request into steps of `HF_RESUMABLE_STEP_TOKENS` tokens, so weights can change between them."""
        return HFCore(self, sampling, step_tokens=HF_RESUMABLE_STEP_TOKENS if resumable else None)

    @torch.no_grad()
    def generate_padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: SamplingConfig,
                        stop: Sequence[int], max_new_tokens: int, seed: int | None
                        ) -> tuple[list[list[int]], list[list[float]] | None]:
        """One transformers `generate` over left-padded rows: (generated ids per row, their log-probs
        when `sampling.calculate_log_probs`). Rows are not cut at their stop token here (finished rows
        are padded by generate); callers cut. `seed` seeds an isolated RNG for the whole batch."""
        width = input_ids.shape[1]
        processor = _SamplingProcessor(sampling, width, record=sampling.calculate_log_probs)
        # Fields left unset would be filled from the model's generation config: set them all. The
        # warpers are neutralised because `processor` does temperature/top-k/top-p itself.
        neutral_warpers = dict(temperature=1.0, top_k=0, top_p=1.0) if sampling.do_sample else {}
        gen_config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=sampling.do_sample,
            num_beams=1,
            eos_token_id=list(stop),
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            use_cache=True,
            **neutral_warpers,
        )
        with self._rng(seed):
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=gen_config,
                logits_processor=LogitsProcessorList([processor]),
            )
        generated = out.sequences[:, width:]
        log_probs = processor.finish(generated) if sampling.calculate_log_probs else None
        return generated.cpu().tolist(), log_probs

    def _rng(self, seed: int | None):
        """Seeded, isolated RNG for a sampling call; the caller's global RNG stream is left as it was."""
        if seed is None:
            return contextlib.nullcontext()
        # The generator generate() draws from is the one of the device the model sits on. Parameters
        # always carry an index; a bare "cuda" means the current device, never blindly GPU 0.
        if self.device.type != "cuda":
            devices = []
        else:
            devices = [self.device.index if self.device.index is not None else torch.cuda.current_device()]

        @contextlib.contextmanager
        def seeded():
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                yield

        return seeded()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy (name, full tensor) pairs into the model in place; names are Hugging Face names."""
        # keep_vars: tied weights appear under every alias, so either name of a tied pair is accepted.
        targets = self.model.state_dict(keep_vars=True)
        count = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in targets:
                    raise ValueError(f"load_weights: unknown parameter {name!r} for {type(self.model).__name__}")
                target = targets[name]
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"load_weights: {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(target.shape)}"
                    )
                target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))
                count += 1
        return count

    @property
    def serves_adapters(self) -> bool:
        """Always: the first `load_adapter` adds PEFT LoRA layers to this backend's own model."""
        return True

    def load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], peft_config: dict) -> int:
        """Copy a LoRA adapter (PEFT file names) into the model's adapter, adding one like it first if
        the model has none yet; the base weights stay as they are."""
        if self._adapter is None:
            self._adapter = _attach_served_adapter(self.model, peft_config)
        count, expected = 0, set(self._adapter)
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = self._adapter.get(name)
                if target is None or tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(f"load_adapter: {name!r} {tuple(tensor.shape)} does not match the served adapter"
                                     f" ({None if target is None else tuple(target.shape)})")
                target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))
                expected.discard(name)
                count += 1
        if expected:
            raise ValueError(f"load_adapter: the adapter lacks {sorted(expected)[:3]} (+{max(len(expected) - 3, 0)})")
        return count

    @torch.no_grad()
    def prompt_log_probs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        result = []
        for tokens in sequences:
            ids = torch.tensor([list(tokens)], dtype=torch.int64, device=self.device)
            logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            result.append(torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].cpu())
        return result

    @property
    def needs_weights(self) -> bool:
        return False  # never sleeps, so it never loses its weights

    def sleep(self) -> None:
        """No-op: the HF model is small enough to stay resident (or is shared with the actor)."""

    def wake_up(self) -> None:
        """No-op, see `sleep`."""

    def shutdown(self) -> None:
        self.model = None


class HFCore:
    """Request batching for an `HFBackend`: each step is one `generate` over every waiting request.

    `step_tokens` (partial rollouts): a step samples at most that many tokens per request; unfinished
    requests stay waiting with what they sampled so far, so a weight update between steps can
    `interrupt` them. None: a request is generated to its end in one step."""

    def __init__(self, backend, sampling: SamplingConfig, max_batch: int | None = None,
                 step_tokens: int | None = None):
        if step_tokens is not None and step_tokens < 1:
            raise ValueError(f"step_tokens={step_tokens} must be >= 1")
        self.backend, self.sampling = backend, sampling
        self.stop = stop_ids_for(sampling, backend.eos_token_ids)
        self.max_batch, self.step_tokens = max_batch, step_tokens
        # (request id, request, ids sampled so far, their log-probs)
        self._waiting: list[tuple[str, TurnRequest, list[int], list[float]]] = []

    def add(self, request_id: str, request: TurnRequest) -> None:
        check_request(request_id, request, self.backend.vocab_size, self.backend.max_model_len)
        self._waiting.append((request_id, request, [], []))

    def step(self) -> list[tuple[str, TurnOutput]]:
        take = len(self._waiting) if self.max_batch is None else min(self.max_batch, len(self._waiting))
        batch, self._waiting = self._waiting[:take], self._waiting[take:]
        if not batch:
            return []
        prompts = [list(r.prompt_ids) + sofar for _, r, sofar, _ in batch]
        limits = [r.max_tokens - len(sofar) for _, r, sofar, _ in batch]
        if self.step_tokens is not None:
            limits = [min(n, self.step_tokens) for n in limits]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(batch), width), self.backend.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(batch), width), dtype=torch.int64)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        seed = batch[0][1].seed if self.sampling.do_sample else None
        if seed is not None and batch[0][2]:  # a later slice of a request: a stream of its own
            seed = derived_seed(seed, len(batch[0][2]))
        responses, lps = self.backend.generate_padded(ids, mask, self.sampling, self.stop, max(limits), seed)
        done, unfinished = [], []
        for i, (rid, r, sofar, sofar_lps) in enumerate(batch):
            out = finish(responses[i], None if lps is None else lps[i], self.stop, limits[i])
            tokens = sofar + list(out.token_ids)
            # without slicing (or when a slice made no progress) a request ends with its step
            if out.finish_reason == "stop" or len(tokens) >= r.max_tokens or self.step_tokens is None \
                    or not out.token_ids:
                full_lps = None if out.log_probs is None else tuple(sofar_lps) + out.log_probs
                done.append((rid, TurnOutput(tuple(tokens), full_lps, out.finish_reason)))
            else:
                unfinished.append((rid, r, tokens, sofar_lps + list(out.log_probs or ())))
        self._waiting = unfinished + self._waiting
        return done

    def has_unfinished(self) -> bool:
        return bool(self._waiting)

    def abort_all(self) -> None:
        self._waiting.clear()

    def interrupt(self) -> list[tuple[str, list[int], list[float] | None]]:
        with_lps = self.sampling.calculate_log_probs
        partial = [(rid, sofar, sofar_lps if with_lps else None) for rid, _, sofar, sofar_lps in self._waiting]
        self._waiting = []
        return partial


def _attach_served_adapter(model: torch.nn.Module, peft_config: dict) -> dict[str, torch.Tensor]:
    """Add a LoRA adapter described by `peft_config` to `model` in place (PEFT); returns its tensors by
    PEFT file name. The layers' forward then adds the adapter's output to the base layer's."""
    import dataclasses

    from peft import LoraConfig, get_peft_model

    from ballast.engine.lora import is_adapter_param, peft_name, use_fused_linear

    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    config = use_fused_linear(LoraConfig(**{k: v for k, v in peft_config.items() if k in fields and k != "peft_type"}))
    config.inference_mode = True
    get_peft_model(model, config)  # injects the LoRA layers into `model` itself
    return {peft_name(name): tensor for name, tensor in model.state_dict(keep_vars=True).items()
            if is_adapter_param(name)}
