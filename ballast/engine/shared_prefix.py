"""Rows that share a prompt, packed with the prompt once (a plan's `shared_prompts` mode).

A GRPO micro-batch holds whole groups of rows with identical prompts (the planner keeps them whole,
`ballast.balance.shared_prompts`). Packed plainly, every row repeats its prompt; packed shared, each
group is one segment `[prompt, response_1, ..., response_n]` and attention lets every response see
the prompt and its own earlier tokens only. Position ids are the rows' own, so each response token
sees exactly the keys, values and positions it would see in its own row: the log-probs, values and
gradients are those of the rows run apart (up to float summation order), for `P + sum(R_i)` tokens
instead of `n * P + sum(R_i)`. The prediction of a row's first response token is the output at the
group's last prompt token, shared by the group.

Rows are grouped by their prompt tokens and position ids (equal prompts share, whatever their uid).
Pure torch: no process group, no model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ballast.engine.padding import ResponseSlots


@dataclass(frozen=True)
class SharedGroup:
    """One segment of the packed sequence: the prompt at `start`, then each response in row order."""

    start: int
    prompt_len: int
    response_lens: tuple[int, ...]

    @property
    def length(self) -> int:
        return self.prompt_len + sum(self.response_lens)


@dataclass(frozen=True)
class SharedPack:
    """A micro-batch packed with each distinct prompt once."""

    input_ids: torch.Tensor  # (T,)
    position_ids: torch.Tensor  # (T,) the rows' own positions
    packed_pos: torch.Tensor  # (N,) output position predicting each real response slot (slots order)
    groups: tuple[SharedGroup, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """(num_groups + 1,) int32 segment bounds: a group is one sequence of the packed layout."""
        bounds = [0]
        for group in self.groups:
            bounds.append(bounds[-1] + group.length)
        return torch.tensor(bounds, dtype=torch.int32, device=self.input_ids.device)

    @property
    def max_seqlen(self) -> int:
        return max((g.length for g in self.groups), default=0)


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                  response_len: int) -> list[list[int]]:
    """Rows with identical prompts (tokens and positions), groups in order of their first row."""
    width = input_ids.shape[1] - response_len
    mask = attention_mask[:, :width].to(torch.bool)
    groups: dict[tuple, list[int]] = {}
    for row in range(input_ids.shape[0]):
        keep = mask[row]
        key = (tuple(input_ids[row, :width][keep].tolist()), tuple(position_ids[row, :width][keep].tolist()))
        groups.setdefault(key, []).append(row)
    return list(groups.values())


def row_prompts(data) -> tuple[np.ndarray, np.ndarray]:
    """(prompt group of every row, in `prompt_groups` order; its prompt's real tokens) of a padded
    batch with `input_ids`, `attention_mask`, `position_ids` and `responses` (what a micro-batch runs
    and what a pass needed both count each group's prompt once)."""
    response_len = data["responses"].shape[1]
    mask = data["attention_mask"]
    prompt_lengths = mask[:, : mask.shape[1] - response_len].sum(-1).cpu().numpy()
    ids = np.zeros(len(prompt_lengths), dtype=np.int64)
    for g, rows in enumerate(prompt_groups(data["input_ids"], mask, data["position_ids"], response_len)):
        ids[rows] = g
    return ids, prompt_lengths


def pack_shared(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                slots: ResponseSlots) -> SharedPack:
    """Pack a padded (B, S) micro-batch with each distinct prompt once (layout: `ballast.engine.padding`)."""
    batch, seq_len = input_ids.shape
    response_len = slots.valid.shape[1]
    width = seq_len - response_len
    mask = attention_mask.to(torch.bool)
    response_lens = mask[:, width:].sum(-1).tolist()
    prompt_end = [0] * batch  # packed index of each row's last prompt token
    response_start = [0] * batch
    ids, pos, groups = [], [], []
    offset = 0
    for rows in prompt_groups(input_ids, attention_mask, position_ids, response_len):
        keep = mask[rows[0], :width]
        ids.append(input_ids[rows[0], :width][keep])
        pos.append(position_ids[rows[0], :width][keep])
        start, prompt_len = offset, int(keep.sum())
        offset += prompt_len
        for row in rows:
            length = int(response_lens[row])
            ids.append(input_ids[row, width:width + length])
            pos.append(position_ids[row, width:width + length])
            prompt_end[row], response_start[row] = start + prompt_len - 1, offset
            offset += length
        groups.append(SharedGroup(start, prompt_len, tuple(int(response_lens[r]) for r in rows)))
    device = input_ids.device
    prompt_end_t = torch.tensor(prompt_end, dtype=torch.int64, device=device)
    start_t = torch.tensor(response_start, dtype=torch.int64, device=device)
    packed_pos = torch.where(slots.cols == 0, prompt_end_t[slots.rows], start_t[slots.rows] + slots.cols - 1)
    return SharedPack(torch.cat(ids), torch.cat(pos), packed_pos, tuple(groups))


def _response_mask(response_len: int, prompt_len: int, device: torch.device) -> torch.Tensor:
    """(R, P + R) bool: every prompt key, then causal over the response's own keys."""
    return torch.ones(response_len, prompt_len + response_len, dtype=torch.bool, device=device).tril(prompt_len)


def shared_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: tuple[SharedGroup, ...],
                            scaling: float | None, dropout: float = 0.0) -> torch.Tensor:
    """Attention over a shared pack. q (1, H, L, D), k/v (1, H_kv, L, D) -> (1, L, H, D); positions
    beyond the groups (Ulysses divisibility padding) get zero output."""
    _, h, length, d = q.shape
    sizes = [n for group in groups for n in (group.prompt_len, *group.response_lens)]
    end = 0
    for group in groups:  # the split below relies on the pack's layout: groups back to back from 0
        assert group.start == end, (group.start, end)
        end += group.length
    if end < length:
        sizes.append(length - end)
    # One split per tensor, not a slice per segment: a split's backward is one concatenation, while
    # every slice's backward fills a zero tensor of the whole sequence and adds into it.
    qs, ks, vs = q.split(sizes, dim=2), k.split(sizes, dim=2), v.split(sizes, dim=2)
    gqa = h != k.shape[1]
    pieces, i = [], 0
    for group in groups:
        p, k_prompt, v_prompt = group.prompt_len, ks[i], vs[i]
        pieces.append(F.scaled_dot_product_attention(qs[i], k_prompt, v_prompt, dropout_p=dropout, is_causal=True,
                                                     scale=scaling, enable_gqa=gqa))
        i += 1
        for r in group.response_lens:
            if r:
                keys = torch.cat([k_prompt, ks[i]], dim=2)
                values = torch.cat([v_prompt, vs[i]], dim=2)
                mask = _response_mask(r, p, q.device)
                pieces.append(F.scaled_dot_product_attention(qs[i], keys, values, attn_mask=mask, dropout_p=dropout,
                                                             scale=scaling, enable_gqa=gqa))
            i += 1
    out = torch.cat(pieces, dim=2).transpose(1, 2) if pieces else q.new_zeros((1, 0, h, d))
    if end < length:
        out = torch.cat([out, q.new_zeros((1, length - end, h, d))], dim=1)
    return out
