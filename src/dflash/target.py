"""Any Hugging Face causal LM as a DFlash target: slot-indexed static cache and hidden-state taps."""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
import torch.nn as nn

from .errors import DFlashConfigError


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer stack of an HF causal LM, found through public accessors."""
    n = model.config.get_text_config().num_hidden_layers
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == n:
        return layers
    for module in model.modules():  # unusual layouts: the ModuleList with one entry per layer
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise DFlashConfigError(f"cannot find the {n} decoder layers of {type(model).__name__}")


@contextmanager
def tap_layers(layers: nn.ModuleList, layer_ids: list[int]):
    """Records the outputs of layers[i] for i in layer_ids into the yielded dict while the block runs."""
    got: dict[int, torch.Tensor] = {}

    def hook(i):
        def fn(module, args, output):
            got[i] = output[0] if isinstance(output, tuple) else output
        return fn

    hooks = [layers[i].register_forward_hook(hook(i)) for i in layer_ids]
    try:
        yield got
    finally:
        for h in hooks:
            h.remove()


def join_rows(a: torch.Tensor, b: torch.Tensor, shifts: tuple[int, int], capacity: int, row_dim: int = 0,
              slot_dim: int = 2) -> torch.Tensor:
    """Stacks the rows of a and b into storage of `capacity` slots, each moved `shifts[i]` slots right."""
    shape = list(a.shape)
    shape[row_dim], shape[slot_dim] = a.shape[row_dim] + b.shape[row_dim], capacity
    out = a.new_zeros(shape)
    for part, first_row, shift in ((a, 0, shifts[0]), (b, a.shape[row_dim], shifts[1])):
        out.narrow(row_dim, first_row, part.shape[row_dim]).narrow(slot_dim, shift, part.shape[slot_dim]).copy_(part)
    return out


class TargetAdapter:
    """Runs the target over slot-indexed KV storage and taps the layers the draft needs.

    Row b's tokens live in cache slots; `valid[b, j]` marks the slots that hold committed tokens of row b.
    Every forward writes its q tokens at slots [pointer, pointer+q). Rolling back is moving the pointer
    (`rewind`), so nothing is re-allocated per step; rows that accepted fewer tokens than others leave
    masked holes until `compact` squeezes them out. Attention runs over the whole storage, so it starts
    small and `grow`s (doubling) only when a sequence outlives it.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int] | None = None):
        self.model = model
        self.config = model.config.get_text_config()
        self.layer_ids = list(layer_ids or [])
        self.layers = decoder_layers(model) if self.layer_ids else None
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.cache = None
        self.valid = None
        self.pointer = 0
        # where the model is now (read several times a step: walking its parameters costs tens of microseconds)
        self.device = next(model.parameters()).device

    # ---- cache ---------------------------------------------------------------------------------------
    def reset(self, batch_size: int, capacity: int) -> None:
        from transformers.cache_utils import Cache, StaticLayer

        # Full static layers everywhere, even for sliding-window models: a ring buffer cannot be rewound.
        self.cache = Cache(layers=[StaticLayer(max_cache_len=capacity) for _ in range(self.config.num_hidden_layers)])
        self.valid = torch.zeros(batch_size, capacity, dtype=torch.bool, device=self.device)
        self.capacity = capacity
        self.pointer = 0

    def grow(self, capacity: int) -> None:
        """Enlarges the slot storage to `capacity` (a rare, amortised copy: capacity at least doubles)."""
        for layer in self.cache.layers:
            layer.max_cache_len = capacity
            if layer.is_initialized:
                for name in ("keys", "values"):
                    old = getattr(layer, name)
                    new = old.new_zeros(old.shape[0], old.shape[1], capacity, old.shape[3])
                    new[:, :, :self.capacity] = old
                    setattr(layer, name, new)
        self.valid = torch.cat([self.valid, self.valid.new_zeros(self.valid.shape[0], capacity - self.capacity)], 1)
        self.capacity = capacity

    def rewind(self, n: int) -> None:
        """Drops the last n written slots (pointer move; the tensors stay where they are)."""
        if n > 0:
            self.cache.crop(-n)
            self.pointer -= n

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keeps only batch rows `keep` (finished rows leave the batch)."""
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.keys = layer.keys.index_select(0, keep)
                layer.values = layer.values.index_select(0, keep)
                layer.batch_size = len(keep)
        self.valid = self.valid.index_select(0, keep)

    def merge(self, other: "TargetAdapter") -> tuple[int, int]:
        """Appends the rows of `other`. Each side's slots shift right so that both end at the same pointer
        (positions travel with the keys, so where a token sits does not matter). Returns the two shifts."""
        p = max(self.pointer, other.pointer)
        shifts = (p - self.pointer, p - other.pointer)
        capacity = max(shifts[0] + self.capacity, shifts[1] + other.capacity)
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = join_rows(mine.keys, theirs.keys, shifts, capacity)
            mine.values = join_rows(mine.values, theirs.values, shifts, capacity)
            mine.batch_size, mine.max_cache_len = mine.keys.shape[0], capacity
            mine.cumulative_length.fill_(p)
        self.valid = join_rows(self.valid, other.valid, shifts, capacity, row_dim=0, slot_dim=1)
        self.capacity, self.pointer = capacity, p
        return shifts

    def put_row(self, row: int, other: "TargetAdapter", shift: int) -> None:
        """Puts the one row of `other` in place of batch row `row`, its slots moved `shift` slots right (so that
        it ends at this batch's pointer); the row's old slots are masked. One row's copy, where `merge` copies all."""
        n = other.pointer
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys[row, :, shift:shift + n] = theirs.keys[0, :, :n]
            mine.values[row, :, shift:shift + n] = theirs.values[0, :, :n]
        self.valid[row] = False
        self.valid[row, shift:shift + n] = other.valid[0, :n]

    def compaction_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Index [b, m] that right-aligns each row's valid slots (as left padding would), and the new valid mask."""
        valid = self.valid[:, :self.pointer]
        counts = valid.sum(1)
        m = int(counts.max())  # >= 1: every row keeps at least its prompt
        # a stable sort of the validity flags puts each row's valid slots last, in their original order
        order = torch.argsort(valid.to(torch.int8), dim=1, stable=True)[:, valid.shape[1] - m:]
        new_valid = torch.arange(m, device=valid.device)[None, :] >= (m - counts)[:, None]
        return order, new_valid

    def compact(self, index: torch.Tensor, new_valid: torch.Tensor) -> None:
        m = index.shape[1]
        for layer in self.cache.layers:
            if not layer.is_initialized:
                continue
            idx = index[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys[:, :, :m] = layer.keys.gather(2, idx)
            layer.values[:, :, :m] = layer.values.gather(2, idx)
        self.rewind(self.pointer - m)
        self.valid.zero_()
        self.valid[:, :m] = new_valid

    # ---- forward -------------------------------------------------------------------------------------
    lazy_head = False  # whether forward(head=False) and `head` are there (the lean runtime on a CPU)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *, capture: bool,
                logits_to_keep: int = 0, slot_valid: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, head: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Writes input_ids [b, q] at slots pointer..pointer+q; returns logits [b, q', V] and features
        [b, q, num_ids*H] (the outputs of the tapped decoder layers, concatenated) when `capture`.
        tree_mask [b, q, q]: which of the new tokens each new token sees (a candidate tree: itself and its
        ancestors); default causal. head=False (where `lazy_head`): the final-normed hidden states [b, q', H]
        in place of the logits; `head` makes the logits of the rows that are read, each as this call would."""
        q = input_ids.shape[1]
        if self.pointer + q > self.capacity:
            raise RuntimeError(f"target cache overflow: {self.pointer}+{q} > {self.capacity}")
        if not head and not self.lazy_head:
            raise DFlashConfigError(f"{type(self).__name__} computes its logits inside the forward (head=False)")
        # the caller decides which of the new slots count; they must be visible to this forward
        self.valid[:, self.pointer:self.pointer + q] = True if slot_valid is None else slot_valid
        logits, taps = self._run(input_ids, position_ids, self.layer_ids if capture else [], logits_to_keep,
                                 tree_mask, **({} if head else {"head": False}))
        self.pointer += q
        features = torch.cat([taps[i] for i in self.layer_ids], dim=-1) if capture else None
        return logits, features

    def _run(self, input_ids, position_ids, tap_ids: list[int], logits_to_keep: int, tree_mask=None):
        """The model's forward over the cache: (logits, {layer id: its output})."""
        mask = self.valid
        if tree_mask is not None:  # a 4-D mask: the committed slots before, the tree among the new ones
            b, q = input_ids.shape
            mask = torch.zeros(b, 1, q, self.capacity, dtype=torch.bool, device=self.valid.device)
            mask[:, 0, :, :self.pointer] = self.valid[:, None, :self.pointer]
            mask[:, 0, :, self.pointer:self.pointer + q] = tree_mask
        with tap_layers(self.layers, tap_ids) as got:
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                             use_cache=True, logits_to_keep=logits_to_keep, **{self._cache_kw: self.cache})
        return out.logits, got

    def gather_slots(self, start: int, index: torch.Tensor) -> None:
        """Moves each row's slots start + index[r, j] to start + j, in every layer (a candidate tree's accepted
        path to consecutive slots, as a chain's accepted tokens lie)."""
        m = index.shape[1]
        for layer in self.cache.layers:
            if not layer.is_initialized:
                continue
            idx = (start + index)[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys[:, :, start:start + m] = layer.keys.gather(2, idx)
            layer.values[:, :, start:start + m] = layer.values.gather(2, idx)


@torch.no_grad()
def target_features(target, layer_ids: list[int], input_ids: torch.Tensor, *, with_logits: bool = False):
    """Outputs of the tapped decoder layers over one whole sequence: [T] -> [T, n_ids*H]; with_logits: also the
    target's next-token logits at every position, [T, V] (what a distilled draft learns from)."""
    with tap_layers(decoder_layers(target), layer_ids) as got:
        # logits_to_keep=1 skips most of the LM head when only the tapped layer outputs are wanted
        out = target(input_ids=input_ids[None].to(target.device), use_cache=False,
                     logits_to_keep=0 if with_logits else 1)
    feats = torch.cat([got[i][0] for i in layer_ids], -1)
    return (feats, out.logits[0]) if with_logits else feats
