"""The DFlash draft: a few Qwen3-style layers that denoise a block of masks conditioned on target features."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from .compiled import compile_frozen
from .config import SLIDING_ATTENTION, DFlashConfig, default_target_layer_ids, rope_settings
from .errors import DFlashConfigError
from .kernels import Int4Weight, Linear, Q8Weight, argmax, cache_attention_kernel, linear, proposal_weight
from .target import join_rows
from .rope import rope_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [b, heads, n, head_dim]; cos/sin: [b, n, head_dim]
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DraftKVCache:
    """Context keys/values of every draft layer in preallocated, position-indexed slots.

    Slot j of row b holds the context entry written there; `valid[b, j]` says whether it is a committed
    token of that row (rejected or padded slots stay masked). Block keys/values are never cached: the block is
    re-drafted every step.
    """

    def __init__(self, config: DFlashConfig, batch_size: int, capacity: int, device, dtype):
        shape = (config.num_hidden_layers, batch_size, config.num_key_value_heads, capacity, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.positions = torch.zeros(batch_size, capacity, dtype=torch.long, device=device)  # absolute positions
        self.capacity = capacity

    def grow(self, capacity: int) -> None:
        pad = capacity - self.capacity
        self.keys = torch.cat([self.keys, self.keys.new_zeros(*self.keys.shape[:3], pad, self.keys.shape[4])], 3)
        self.values = torch.cat([self.values, self.values.new_zeros(*self.values.shape[:3], pad,
                                                                    self.values.shape[4])], 3)
        self.positions = torch.cat([self.positions, self.positions.new_zeros(self.positions.shape[0], pad)], 1)
        self.capacity = capacity

    def select_rows(self, keep: torch.Tensor) -> None:
        self.keys = self.keys.index_select(1, keep)
        self.values = self.values.index_select(1, keep)
        self.positions = self.positions.index_select(0, keep)

    def merge(self, other: "DraftKVCache", shifts: tuple[int, int], capacity: int) -> None:
        """Appends other's rows, each side's slots shifted right as the target cache's were."""
        self.keys = join_rows(self.keys, other.keys, shifts, capacity, row_dim=1, slot_dim=3)
        self.values = join_rows(self.values, other.values, shifts, capacity, row_dim=1, slot_dim=3)
        self.positions = join_rows(self.positions, other.positions, shifts, capacity, row_dim=0, slot_dim=1)
        self.capacity = capacity

    def put_row(self, row: int, other: "DraftKVCache", shift: int, n: int) -> None:
        """Puts other's one row (its first n slots) in place of row `row`, shifted as the target cache's was."""
        self.keys[:, row, :, shift:shift + n] = other.keys[:, 0, :, :n]
        self.values[:, row, :, shift:shift + n] = other.values[:, 0, :, :n]
        self.positions[row, shift:shift + n] = other.positions[0, :n]

    def gather_slots(self, index: torch.Tensor) -> None:
        """Moves slots so that row b's slot j takes old slot index[b, j] (used to compact the cache)."""
        n = index.shape[1]
        idx = index[None, :, None, :, None].expand(self.keys.shape[0], -1, self.keys.shape[2], -1, self.keys.shape[4])
        self.keys[:, :, :, :n] = self.keys.gather(3, idx)
        self.values[:, :, :, :n] = self.values.gather(3, idx)
        self.positions[:, :n] = self.positions.gather(1, index)


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from [context; block], both through this layer's projections."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim ** -0.5
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == SLIDING_ATTENTION else None

    def kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v  # [b, kv_heads, n, head_dim]

    def forward(self, x, rope_x, ctx_k, ctx_v, mask):
        # x: [b, Q, H] block states; ctx_k/ctx_v: [b, kv_heads, T, head_dim]; mask: [b, 1, Q, T+Q] bool
        b, Q, _ = x.shape
        cos, sin = rope_x
        q = self.q_norm(self.q_proj(x).view(b, Q, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)
        k = torch.cat([ctx_k, k_blk], dim=2)
        v = torch.cat([ctx_v, v_blk], dim=2)
        gqa = self.num_kv_heads != self.num_heads
        if gqa and q.is_cuda:  # with a mask, SDPA's GQA falls back to its unfused kernel on a GPU (see dflash.fast)
            k, v = (t.repeat_interleave(self.num_heads // self.num_kv_heads, 1) for t in (k, v))
            gqa = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, Q, -1))

    def forward_blocks(self, x, rope_x, ctx_k, ctx_v, mask):
        """Training: n packed blocks of one sequence (see block_sparse_attention). x: [n, B, H];
        ctx_k/ctx_v: [kv_heads, T, head_dim]; rope_x: cos/sin [n, B, head_dim]; mask: from block_masks."""
        n, B, _ = x.shape
        cos, sin = rope_x
        q = apply_rope(self.q_norm(self.q_proj(x).view(n, B, self.num_heads, self.head_dim)).transpose(1, 2), cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)  # [n, kv_heads, B, head_dim]
        args = (q.transpose(0, 1), ctx_k, ctx_v, k_blk.transpose(0, 1), v_blk.transpose(0, 1))
        if isinstance(mask, tuple):
            out = block_sparse_attention(*args, *mask, self.scaling)  # [h, n, B, d]
        else:
            out = flex_block_attention(*args, mask, self.scaling)
        return self.o_proj(out.permute(1, 2, 0, 3).reshape(n, B, -1))


def block_sparse_attention(q, k_ctx, v_ctx, k_blk, v_blk, ctx_bias, blk_bias, scale: float) -> torch.Tensor:
    """Training attention of n packed blocks: each block's queries see a prefix of the context and their own
    block, never another block. One softmax over [context; own block] is exactly the dense masked attention
    over [context; all blocks] (the other blocks' keys would get weight 0), without the n*B x n*B block part,
    which grows with the square of the anchors.
    q: [h, n, B, d]; k_ctx, v_ctx: [kv_heads, T, d]; k_blk, v_blk: [kv_heads, n, B, d];
    ctx_bias: [n, B, T] additive (0 or -inf); blk_bias: [B, B] additive. Returns [h, n, B, d]."""
    h, n, B, d = q.shape
    kv, T = k_ctx.shape[0], k_ctx.shape[1]
    qg = q.reshape(kv, h // kv * n * B, d)  # query heads grouped by the key/value head they share
    s_ctx = torch.bmm(qg, k_ctx.transpose(1, 2)).view(kv, h // kv, n, B, T) * scale + ctx_bias
    s_blk = torch.matmul(q.reshape(kv, h // kv, n, B, d), k_blk[:, None].transpose(-1, -2)) * scale + blk_bias
    p = torch.cat([s_ctx, s_blk], -1).softmax(-1)
    p_ctx, p_blk = p.split([T, B], -1)
    out = torch.bmm(p_ctx.reshape(kv, -1, T), v_ctx).view(kv, h // kv, n, B, d) + torch.matmul(p_blk, v_blk[:, None])
    return out.view(h, n, B, d)


def block_masks(anchors, ctx_pos, x_pos, window: int | None, dtype, flex: bool):
    """What a layer's training attention over n packed blocks needs: block i sees the context before anchors[i]
    and its own block (sliding-window layers: only keys less than a window behind, causal in the block).
    anchors [n]; ctx_pos [T]; x_pos [n, B]. Additive biases for block_sparse_attention, or flex: a BlockMask."""
    n, B = x_pos.shape
    T = ctx_pos.shape[0]
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask

        q_pos, key_pos = x_pos.reshape(-1), torch.cat([ctx_pos, x_pos.reshape(-1)])

        def visible(b, h, qi, ki):
            block = qi // B
            ok = torch.where(ki < T, key_pos[ki] < anchors[block], (ki - T) // B == block)
            if window is not None:
                dist = q_pos[qi] - key_pos[ki]
                ok = ok & (dist >= 0) & (dist < window)
            return ok
        return create_block_mask(visible, None, None, n * B, T + n * B, device=x_pos.device)
    ctx_ok = ctx_pos[None, None, :] < anchors[:, None, None]  # [n, 1, T]
    blk_ok = torch.ones(B, B, dtype=torch.bool, device=x_pos.device)
    if window is not None:
        dist = x_pos[:, :, None] - ctx_pos[None, None, :]  # [n, B, T]
        ctx_ok = ctx_ok & (dist >= 0) & (dist < window)
        dist = x_pos[0, :, None] - x_pos[0, None, :]
        blk_ok = (dist >= 0) & (dist < window)
    return tuple(torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
                 for m in (ctx_ok, blk_ok))


def flex_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, block_mask, scale: float) -> torch.Tensor:
    """block_sparse_attention through PyTorch's flex attention, the training path on a GPU: one fused kernel that
    skips the masked tiles and never holds the scores (at the published scale, 512 anchors x 16 slots over ~11k
    keys, the scores alone would be ~12 GB per layer kept for backward). Shapes as block_sparse_attention."""
    from torch.nn.attention.flex_attention import flex_attention

    h, n, B, d = q.shape
    kv = k_ctx.shape[0]
    k = torch.cat([k_ctx, k_blk.reshape(kv, n * B, d)], 1)[None]
    v = torch.cat([v_ctx, v_blk.reshape(kv, n * B, d)], 1)[None]
    attend = _compiled_flex() if q.is_cuda else flex_attention
    out = attend(q.reshape(1, h, n * B, d), k, v, block_mask=block_mask, scale=scale, enable_gqa=kv != h)
    return out.view(h, n, B, d)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def block_attention_mask(visible: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                         window: int | None) -> torch.Tensor:
    """[b, 1, Q, K] mask from the keys each query may see. Full-attention layers use `visible` as is
    (non-causal); sliding-window layers also require 0 <= q_pos - k_pos < window (causal, windowed).
    visible: [b, Q|1, K] bool; q_pos: [b, Q]; k_pos: [b, K]."""
    if window is not None:
        dist = q_pos[:, :, None] - k_pos[:, None, :]
        visible = visible & (dist >= 0) & (dist < window)
    return visible[:, None]


def layer_masks(config, visible, q_pos, k_pos) -> list[torch.Tensor]:
    """One mask per draft layer (layers of the same kind share theirs)."""
    cache = {}
    out = []
    for t in config.layer_types:
        window = config.sliding_window if t == SLIDING_ATTENTION else None
        if window not in cache:
            cache[window] = block_attention_mask(visible, q_pos, k_pos, window)
        out.append(cache[window])
    return out


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)


def _init_weights(module: nn.Module, std: float) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)


class DFlashDraftModel(nn.Module):
    """Block-diffusion draft. Owns no embedding or LM head: `bind(target)` borrows the target's, frozen."""

    DRAFT_METHOD = "dflash"  # the config's draft_method this class loads

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = Linear(config.num_context_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        self.rotary_emb = Qwen3RotaryEmbedding(config.to_qwen3_config())
        # the target's modules, kept outside the module tree so they are neither saved nor trained
        self._target_modules: tuple[nn.Module, nn.Module] | None = None
        # optional: the token ids the draft may propose (its LM head is evaluated on these rows only)
        self.register_buffer("draft_vocab", None)
        self._head_cache = self._proposal_cache = None
        self._compiled = None  # see compiled()
        self.keep_confidence = False  # whether greedy_tokens leaves `last_confidence` (a step that trims asks)
        self.last_confidence: torch.Tensor | None = None
        self._stack = None  # see _layer_stack()
        # bits of the layer weights the CPU fast path multiplies by at inference (_layer_stack): 8 (Q8_0), or 4
        # (Q4_1) beside a target that runs at 4 bits (SpecBatch sets it from the runtime). The proposal head keeps
        # 8 bits, as 4-bit GGUF targets keep their output layer: the default draft's held-out τ (dflash evaluate,
        # 40 x 128 tokens per set) was 1.775 all at 8 bits, 1.772 with 4-bit layers, 1.756 with a 4-bit head too
        self.inference_bits = 8

    def _apply(self, fn, recurse=True):
        # RoPE frequencies stay fp32 whatever dtype the draft is cast to: trained with fp32 frequencies, a bf16
        # draft would otherwise run with rounded ones (0.3% off), which drifts the angles at long context
        freqs = {name: b for name, b in self.rotary_emb.named_buffers(recurse=False) if b is not None}
        out = super()._apply(fn, recurse)
        for name, old in freqs.items():
            new = self.rotary_emb._buffers[name]
            if new is not None and new.dtype != old.dtype and new.device.type != "meta":
                self.rotary_emb._buffers[name] = old.to(new.device)
        return out

    # ---- construction --------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target, num_layers: int = 1, block_size: int = 16, target_layer_ids=None,
                    mask_token_id: int | None = None, tokenizer=None, num_target_features: int | None = None,
                    num_key_value_heads: int | None = None, intermediate_size: int | None = None):
        """A fresh (untrained) draft sized for `target`, any Hugging Face causal LM; its key/value heads and MLP
        width are the target's unless `num_key_value_heads` / `intermediate_size` say otherwise."""
        tc = target.config.get_text_config()
        L = tc.num_hidden_layers
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(L, num_target_features or num_layers)
        vocab = target.get_input_embeddings().weight.shape[0]
        if mask_token_id is None:
            mask_token_id = choose_mask_token_id(target, tokenizer)
        theta, scaling = rope_settings(tc)
        heads = tc.num_attention_heads
        config = DFlashConfig(
            hidden_size=tc.hidden_size, intermediate_size=intermediate_size or tc.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=num_key_value_heads or getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
            num_target_layers=L, target_layer_ids=list(target_layer_ids), mask_token_id=int(mask_token_id),
            vocab_size=vocab, num_hidden_layers=num_layers, block_size=block_size,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
        )
        param = next(target.parameters())
        draft = cls(config).to(device=param.device, dtype=param.dtype)
        draft.reset_parameters()
        draft.bind(target)
        # start the draft's final norm at the target's effective one, so its logits begin at the target's
        # scale (a unit norm can give logits ~10x too large and a first loss far above ln(vocab))
        final_norm = getattr(target.get_decoder(), "norm", None) if hasattr(target, "get_decoder") else None
        if final_norm is not None:
            with torch.no_grad():
                probe = torch.ones(1, config.hidden_size, device=param.device, dtype=param.dtype)
                scale = final_norm(probe)[0]  # RMSNorm of an all-ones vector = its effective weight
                if scale.shape == draft.norm.weight.shape and torch.isfinite(scale).all():
                    draft.norm.weight.copy_(scale)
        return draft

    def init_from_target_layers(self, target, layer_ids: list[int]) -> list[str]:
        """Copies target decoder layer layer_ids[i] into draft layer i wherever names and shapes agree
        (projections, MLP, norms), so training starts from a working transformer layer. Returns what it copied."""
        from .target import decoder_layers

        layers = decoder_layers(target)
        copied = []
        with torch.no_grad():
            for i, lid in enumerate(layer_ids):
                src = layers[lid].state_dict()
                for name, p in self.layers[i].state_dict().items():
                    if name in src and src[name].shape == p.shape:
                        p.copy_(src[name])
                        copied.append(f"layers.{i}.{name}")
        return copied

    def grow_layers(self, num_layers: int, std: float = 0.02) -> int:
        """Appends decoder layers up to `num_layers` that start as the identity: their attention output and MLP
        down projections are zero, so the residual stream, and so every proposal, is unchanged until training
        moves them. A trained draft gains depth without losing what it learned. Returns the layers added."""
        have = self.config.num_hidden_layers
        if num_layers < have:
            raise DFlashConfigError(f"cannot grow a {have}-layer draft to {num_layers} layers")
        ref = next(self.parameters())
        for i in range(have, num_layers):
            self.config.layer_types = [*self.config.layer_types, self.config.layer_types[-1]]
            self.config.num_hidden_layers = i + 1
            layer = DFlashDecoderLayer(self.config, i).to(device=ref.device, dtype=ref.dtype)
            _init_weights(layer, std)
            with torch.no_grad():
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            self.layers.append(layer)
        return num_layers - have  # compiled() rebuilds on the new parameters; the head caches do not see layers

    def widen_mlp(self, intermediate_size: int, std: float = 0.02) -> int:
        """Gives every layer's MLP `intermediate_size` hidden units, at least what it has: the new units' gate and
        up rows start random and their down-projection columns zero, so every proposal is unchanged until training
        moves them (room in width instead of depth: no layer added to a step's sequence). Returns the units added
        per layer."""
        have = self.config.intermediate_size
        if intermediate_size < have:
            raise DFlashConfigError(f"cannot widen the draft's MLP from {have} to {intermediate_size} units")
        self.config.intermediate_size = intermediate_size
        for layer in self.layers:
            old = layer.mlp
            ref = old.down_proj.weight
            new = DFlashMLP(self.config).to(device=ref.device, dtype=ref.dtype)
            _init_weights(new, std)
            with torch.no_grad():
                new.gate_proj.weight[:have].copy_(old.gate_proj.weight)
                new.up_proj.weight[:have].copy_(old.up_proj.weight)
                new.down_proj.weight.zero_()
                new.down_proj.weight[:, :have].copy_(old.down_proj.weight)
            layer.mlp = new
        return intermediate_size - have

    def widen_kv_heads(self, num_kv_heads: int) -> None:
        """Gives every layer `num_kv_heads` key/value heads, a multiple of what it has (and a divisor of its
        attention heads), each a copy of the grouped head its query heads read today: every proposal is
        unchanged until training lets the copies part. A trained GQA draft so gains the MHA draft's room."""
        have, heads = self.config.num_key_value_heads, self.config.num_attention_heads
        if num_kv_heads % have or heads % num_kv_heads:
            raise DFlashConfigError(f"cannot widen {have} key/value heads to {num_kv_heads}: the new count must be "
                                    f"a multiple of {have} and divide the {heads} attention heads")
        copies = num_kv_heads // have
        for layer in self.layers:
            attn = layer.self_attn
            for name in ("k_proj", "v_proj"):
                old = getattr(attn, name)
                new = Linear(old.in_features, num_kv_heads * attn.head_dim, bias=old.bias is not None)
                new.to(device=old.weight.device, dtype=old.weight.dtype)
                with torch.no_grad():  # query head h reads kv head h // (heads / kv heads): copy in that order
                    new.weight.copy_(old.weight.view(have, attn.head_dim, -1).repeat_interleave(copies, 0)
                                     .reshape(new.weight.shape))
                    if old.bias is not None:
                        new.bias.copy_(old.bias.view(have, -1).repeat_interleave(copies, 0).reshape(-1))
                setattr(attn, name, new)
            attn.num_kv_heads = num_kv_heads
        self.config.num_key_value_heads = num_kv_heads

    def reset_parameters(self, std: float = 0.02) -> None:
        _init_weights(self, std)

    def bind(self, target) -> "DFlashDraftModel":
        """Checks that this draft fits `target` and borrows its embedding and LM head."""
        check_fits(self.config, target)
        emb, head = target.get_input_embeddings(), target.get_output_embeddings()
        if head is None:
            raise DFlashConfigError(f"{type(target).__name__} has no output embeddings (LM head)")
        self._target_modules = (emb, head)
        return self

    def is_bound_to(self, target) -> bool:
        return self._target_modules is not None and self._target_modules[0] is target.get_input_embeddings()

    @property
    def embed_tokens(self) -> nn.Module:
        return self._bound()[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._bound()[1]

    def _bound(self):
        if self._target_modules is None:
            raise DFlashConfigError("draft is not bound to a target: call draft.bind(target) first")
        return self._target_modules

    # ---- checkpoint --------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | os.PathLike) -> None:
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        self.config.dtype = str(next(self.parameters()).dtype).removeprefix("torch.")
        write_draft(directory, state, self.config)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, target=None, *, device=None, dtype=None):
        """Loads a draft in the published format from a local folder (or a hub id when online): one
        model.safetensors, or shards named by model.safetensors.index.json. The weights are read straight into
        the draft: it is built on the meta device, without a random initialisation or an fp32 copy first."""
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            directory = draft_folder(directory)
        config = DFlashConfig.load(directory)
        if config.draft_method != cls.DRAFT_METHOD:
            raise DFlashConfigError(f"{directory} holds a {config.draft_method} draft, not a {cls.DRAFT_METHOD} one: "
                                    "load it with dflash.load_draft, which picks the class its config names")
        state = {k.removeprefix("model."): v for k, v in _read_weights(directory).items()
                 if not k.endswith(("embed_tokens.weight", "lm_head.weight"))}
        if target is not None:
            param = next(target.parameters())
            device, dtype = device or param.device, dtype or param.dtype
        if dtype is None and config.dtype:
            dtype = getattr(torch, config.dtype, None)
        device = torch.device(device or "cpu")
        with torch.device("meta"):
            model = cls(config)
        # the RoPE tables are computed, not stored: made for real, in fp32, where the draft will run
        with torch.device(device):
            model.rotary_emb = type(model.rotary_emb)(config.to_qwen3_config())
        if "draft_vocab" in state:
            model.draft_vocab = torch.empty_like(state["draft_vocab"], device="meta")
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if "rotary_emb" not in k]
        if missing or unexpected:
            raise DFlashConfigError(f"draft checkpoint in {directory} does not match its config: "
                                    f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        model = model.to(device=device, dtype=dtype)
        if target is not None:
            model.bind(target)
        return model

    # ---- forward -----------------------------------------------------------------------------------
    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        # [b, n, num_ids*H] -> [b, n, H]
        return self.hidden_norm(self.fc(target_features))

    def context_kv(self, target_features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's context keys/values [b, kv_heads, n, head_dim] from target features [b, n, num_ids*H]
        at absolute positions [b, n]: the features are injected into each layer through its own k/v projections."""
        ctx = self.project_context(target_features.to(self.fc.weight.dtype))
        rope = self.rotary_emb(ctx, positions)
        return [layer.self_attn.kv(ctx, *rope) for layer in self.layers]

    def write_context(self, target_features: torch.Tensor, cache: DraftKVCache, slot: int,
                      compile: bool = False) -> None:
        """Adds target features [b, n, num_ids*H] to the cache at slots slot..slot+n (their absolute positions
        must already be in cache.positions). compile: through torch.compile (see `compiled`)."""
        n = target_features.shape[1]
        if n == 0:
            return
        stack = None if compile else self._layer_stack()
        if stack is not None:
            x = target_features.to(self.fc.weight.dtype)
            cos, sin = rope_tables(self.rotary_emb, x, cache.positions[:, slot:slot + n])
            torch.ops.dflash_attn.context_kv(x, cos, sin, slot, list(cache.keys), list(cache.values), stack[3],
                                             self.config.num_key_value_heads, self.config.rms_norm_eps, stack[2])
            return
        # one slot (a single plain step since the last write) runs eagerly: torch.compile specialises a size
        # of 1, and a graph for it would cost a compile for one small product
        context_kv = self.compiled()[1] if compile and n > 1 else self.context_kv
        for i, (k, v) in enumerate(context_kv(target_features, cache.positions[:, slot:slot + n])):
            cache.keys[i, :, :, slot:slot + n] = k
            cache.values[i, :, :, slot:slot + n] = v

    def forward(self, block_ids: torch.Tensor, block_pos: torch.Tensor, cache: DraftKVCache,
                ctx_valid: torch.Tensor) -> torch.Tensor:
        """Fills one block per row; returns the final hidden states of all B block slots [b, B, H].

        block_ids, block_pos: [b, B] ([anchor, MASK, ...] at positions start..start+B-1).
        ctx_valid: [b, T] which of the first T cache slots are committed context of each row.
        """
        b, T = ctx_valid.shape
        B = block_ids.shape[1]
        # every block slot sees all committed context and the whole block (sliding layers narrow this)
        visible = torch.cat([ctx_valid, ctx_valid.new_ones(b, B)], 1)[:, None, :]
        x = self.embed_tokens(block_ids).to(self.fc.weight.dtype)
        stack = self._layer_stack()
        if stack is not None:
            # the block's keys and values go to slots T..T+B of the draft cache, where the context written after
            # this step lands: nothing reads them as context before that
            cos, sin = rope_tables(self.rotary_emb, x, block_pos)
            c = self.config
            x, _ = torch.ops.dflash_attn.decoder_layers(
                x, cos, sin, visible.expand(b, B, T + B).contiguous(), T, list(cache.keys), list(cache.values),
                stack[1], [], c.num_attention_heads, c.num_key_value_heads, c.rms_norm_eps, c.head_dim ** -0.5,
                stack[2])
            return self.norm(x)
        masks = layer_masks(self.config, visible, block_pos, torch.cat([cache.positions[:, :T], block_pos], 1))
        return self.run_layers(x, block_pos,
                               [(cache.keys[i, :, :, :T], cache.values[i, :, :, :T]) for i in range(len(self.layers))],
                               masks)

    def _tensors(self, buffers: bool = False) -> list[torch.Tensor]:
        """The draft's parameters (and buffers), found by walking the modules' own tables, for the keys of the
        cached layer stack and graphs, checked at every propose and context write: with `self.parameters()`
        (names, a set of seen tensors) the stack's check took ~80 us, this way ~20 (SmolLM2's one-layer draft,
        AMD EPYC AVX2, timeit). A tensor shared by two modules comes twice, which changes no key."""
        out, stack = [], [self]
        while stack:
            m = stack.pop()
            out += [t for t in m._parameters.values() if t is not None]
            if buffers:
                out += [t for t in m._buffers.values() if t is not None]
            stack += [c for c in m._modules.values() if c is not None]
        return out

    def _layer_stack(self):
        """(key, weights, op, context weights) for running the draft at inference through the attention kernel's
        library: its layers as one `decoder_layers` call (norms, fused q/k/v product, q/k norms, RoPE, attention,
        MLP, residuals, each row alone) and its context write as one `context_kv` call (fc, hidden_norm, each
        layer's fused k/v product, k_norm, RoPE, into the cache); None where that does not apply. It applies to bf16
        weights on a CPU where dflash's Q8_0 kernel runs and no layer has a sliding window. Where the CPU has no
        bf16 kernels the Python layers multiply on that kernel too (dflash.kernels.linear): the same products,
        bitwise (q, k and v in one, gate and up in one: each output computed alone), without the some forty small
        PyTorch ops of a layer. Where oneDNN packs bf16 it pays all the same: on an AVX-512 (AMX) Xeon, 2 threads,
        the default draft's propose took 1.2 ms instead of 2.1 and its context write 0.3 instead of 0.7
        (benchmarks/profile_step.py), the 8-bit weights streaming half the bytes of the packed bf16 ones.
        The norms, SiLU and attention are the library's arithmetic, a rounding away from PyTorch's: proposals,
        never the output. Rebuilt when a weight changes."""
        w = self.fc.weight
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or w.dtype != torch.bfloat16 or w.is_cuda:
            return None
        params = self._tensors()
        key = (self.inference_bits, *((id(p), p._version, p.data_ptr()) for p in params))
        if self._stack is not None and self._stack[0] == key:
            return self._stack
        c = self.config
        if (c.head_dim % 16 or c.hidden_size % 16 or SLIDING_ATTENTION in c.layer_types or
                not all(Q8Weight.fits(p) for p in params if p.dim() == 2) or
                not cache_attention_kernel()):
            return None
        # one kind of weight for the whole stack (the library calls one product op); Q4_1 needs outputs in 16s
        four = self.inference_bits == 4 and all(Int4Weight.fits(p) for p in params if p.dim() == 2)
        quantized = functools.partial(Int4Weight, ours=True) if four else Q8Weight
        fc = quantized(self.fc.weight)
        weights, context = [], [fc.qweight, fc.scales, None, self.hidden_norm.weight]
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            qkv = quantized(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
            bqkv = None if a.q_proj.bias is None else torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            o = quantized(a.o_proj.weight)
            gu = quantized(torch.cat([m.gate_proj.weight, m.up_proj.weight]))
            down = quantized(m.down_proj.weight)
            weights += [layer.input_layernorm.weight, qkv.qweight, qkv.scales, bqkv, a.q_norm.weight,
                        a.k_norm.weight, o.qweight, o.scales, a.o_proj.bias, layer.post_attention_layernorm.weight,
                        gu.qweight, gu.scales, None, down.qweight, down.scales, None]
            kv = quantized(torch.cat([a.k_proj.weight, a.v_proj.weight]))
            context += [kv.qweight, kv.scales, None if bqkv is None else bqkv[a.q_proj.weight.shape[0]:], a.k_norm.weight]
        self._stack = (key, weights, qkv.op.default._schema.name, context)
        return self._stack

    def run_layers(self, x, x_pos, ctx_kv, masks) -> torch.Tensor:
        """The decoder stack over block states x [b, Q, H] at positions x_pos [b, Q], with each layer's context
        keys/values ctx_kv[i] and attention mask masks[i]."""
        rope_x = self.rotary_emb(x, x_pos)
        for layer, (k, v), mask in zip(self.layers, ctx_kv, masks):
            x = x + layer.self_attn(layer.input_layernorm(x), rope_x, k, v, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def run_blocks(self, x, x_pos, ctx_kv, anchors, ctx_pos, flex: bool | None = None) -> torch.Tensor:
        """Training: the decoder stack over n packed blocks x [n, B, H] at positions x_pos [n, B], block i seeing
        the context before anchors[i] and its own block (block_sparse_attention); ctx_kv[i]: layer i's context
        keys/values [kv_heads, T, head_dim] at positions ctx_pos [T]. Sliding-window layers also see only keys
        less than a window behind, as at inference. flex: through flex attention (None: on a GPU)."""
        flex = x.is_cuda if flex is None else flex
        rope_x = self.rotary_emb(x, x_pos)
        masks = {}
        for layer, (k, v) in zip(self.layers, ctx_kv):
            window = layer.self_attn.sliding_window
            if window not in masks:
                masks[window] = block_masks(anchors, ctx_pos, x_pos, window, x.dtype, flex)
            x = x + layer.self_attn.forward_blocks(layer.input_layernorm(x), rope_x, k, v, masks[window])
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def packed_blocks(self, features, block_ids, block_pos, anchors) -> torch.Tensor:
        """Training (and teacher-forced measuring): final hidden states [n, B, H] of n blocks of one sequence in
        one packed forward. The whole sequence is context (features [T, n_ids*H]); block i (block_ids,
        block_pos [n*B], see block_inputs) sees the part before anchors[i]."""
        B, T = self.config.block_size, features.shape[0]
        dev = features.device
        block_ids, block_pos = block_ids.to(dev).view(-1, B), block_pos.to(dev).view(-1, B)
        ctx_pos = torch.arange(T, device=dev)
        ctx_kv = [(k[0], v[0]) for k, v in self.context_kv(features[None], ctx_pos[None])]
        x = self.embed_tokens(block_ids).to(self.fc.weight.dtype)
        return self.run_blocks(x, block_pos, ctx_kv, anchors.to(dev), ctx_pos)

    def set_draft_vocab(self, token_ids) -> None:
        """Restricts proposals to `token_ids` (None: the whole vocabulary). On a CPU the LM head over 15 mask
        slots can cost as much as the draft itself; the few thousand most frequent answer tokens cover most
        of the text. Proposals only: the target still verifies, so the output stays exact."""
        if token_ids is not None:
            token_ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.fc.weight.device).unique()
            size = self.config.vocab_size
            if token_ids.numel() == 0:
                raise DFlashConfigError("a draft vocabulary needs at least one token id")
            low, high = int(token_ids[0]), int(token_ids[-1])  # sorted by unique()
            if low < 0 or high >= size:
                raise DFlashConfigError(f"a draft vocabulary needs token ids in 0..{size - 1} (the target's "
                                        f"vocabulary); got ids from {low} to {high}")
        self.draft_vocab = token_ids
        self._head_cache = self._proposal_cache = None

    def _draft_head(self):
        w = self.lm_head.weight
        if self._head_cache is None or self._head_cache[0] is not w:
            rows = self.draft_vocab.to(w.device)
            bias = getattr(self.lm_head, "bias", None)
            self._head_cache = (w, w[rows].contiguous(), None if bias is None else bias[rows], rows)
        return self._head_cache[1:]

    def _proposal_head(self):
        """(weight, bias, rows) that proposals are scored with: the draft vocabulary's LM-head rows (rows None:
        the whole head). A bf16 weight is Q8_0 on a CPU where dflash's kernel runs, else int8 where the CPU has no
        half-precision kernels (`kernels.proposal_weight`). Proposals only: the target verifies them."""
        w = self.lm_head.weight
        if self._proposal_cache is None or self._proposal_cache[0] is not w:
            weight, bias, rows = (self._draft_head() if self.draft_vocab is not None
                                  else (w, getattr(self.lm_head, "bias", None), None))
            self._proposal_cache = (w, proposal_weight(weight), bias, rows)
        return self._proposal_cache[1:]

    @torch.inference_mode()
    def prepare(self) -> None:
        """Builds now what inference otherwise builds at its first use: the quantized layer stack and proposal
        head (tens of ms for the default draft, AVX-512 Xeon). Paid inside the first drafted step, that cost
        priced drafting several times too dear: a width controller fitted to it verified whole blocks or stayed
        plain for a whole answer (see SpecBatch)."""
        self._layer_stack()
        self._proposal_head()

    def propose(self, block_ids: torch.Tensor, block_pos: torch.Tensor, cache: DraftKVCache,
                ctx_valid: torch.Tensor, compile: bool = False) -> torch.Tensor:
        """Greedy draft tokens [b, B-1] for the mask slots of each block (greedy even when the target samples:
        a one-hot proposal keeps acceptance high and the verification rule keeps the output exact).
        compile: the layers through torch.compile (see `compiled`); the head stays eager."""
        body = self.compiled()[0] if compile else self
        return self.greedy_tokens(body(block_ids, block_pos, cache, ctx_valid)[:, 1:])

    def propose_topk(self, block_ids: torch.Tensor, block_pos: torch.Tensor, cache: DraftKVCache,
                     ctx_valid: torch.Tensor, k: int, compile: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most probable tokens at every mask slot and their log-probabilities, [b, B-1, k] each (over the
        draft vocabulary if set): what a candidate tree is built from (dflash.tree)."""
        body = self.compiled()[0] if compile else self
        hidden = body(block_ids, block_pos, cache, ctx_valid)[:, 1:]
        b, n, h = hidden.shape
        weight, bias, rows = self._proposal_head()
        logp = torch.log_softmax(linear(hidden.reshape(b * n, h).to(self.lm_head.weight.dtype), weight, bias).float(), -1)
        top, ids = logp.topk(min(k, logp.shape[-1]), -1)
        ids = ids if rows is None else rows[ids]
        return ids.view(b, n, -1), top.view(b, n, -1)

    def compiled(self):
        """(forward, context_kv) through torch.compile for inference (`dflash.compiled.compile_frozen`: no guards
        on the weights before every call). Built on first use, and again whenever a tensor of the draft or of
        the borrowed embedding is replaced or changes dtype, shape or device; values written in place need
        nothing, the graphs read the tensors at every call."""
        tensors = (*self._tensors(buffers=True), self.embed_tokens.weight)
        key = tuple((id(t), t.dtype, t.shape, t.device) for t in tensors)
        if self._compiled is None or self._compiled[0] != key:
            state = (self, self.embed_tokens)
            self._compiled = (key, compile_frozen(self.forward, state), compile_frozen(self.context_kv, state))
        return self._compiled[1:]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Argmax token ids [b, n] of final (normed) states hidden [b, n, H], over the draft vocabulary if set.
        With `keep_confidence`, leaves the draft's probability of each in `last_confidence` [b, n] (fp32), a
        softmax over the vocabulary's rows that only a step trimming its block pays for. A trained draft's are
        close to how often its proposals are accepted, which is what an adaptive step reads to verify only the
        proposals worth their cost (`WidthController.trim`, which corrects them by what was accepted)."""
        b, n, h = hidden.shape
        # 2-D and contiguous: a strided 3-D input sends F.linear down a bmm path that copies the whole
        # (vocab x hidden) weight on every call (measured: 41 of 54 ms per step on SmolLM2)
        hidden = hidden.reshape(b * n, h).to(self.lm_head.weight.dtype)
        weight, bias, rows = self._proposal_head()
        logits = linear(hidden, weight, bias)
        ids = argmax(logits)
        self.last_confidence = None
        if self.keep_confidence:
            logits = logits.float()
            self.last_confidence = (logits.gather(1, ids[:, None])[:, 0] - logits.logsumexp(1)).exp().view(b, n)
        return (ids if rows is None else rows[ids]).view(b, n)


def head_loss(d, hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None, *,
              target_logits: torch.Tensor | None = None, positions: torch.Tensor | None = None, distill: float = 0.0):
    """Weighted cross-entropy of the draft's (already normed) final states hidden [..., H] against labels [...]
    (-100: not counted), and which predictions were right ([...] float, 0 where not counted).

    distill > 0 mixes in the cross-entropy against the target's own next-token distribution: row r learns from
    softmax(target_logits[positions[r]]) (target_logits [T, V], positions [...]), with weight distill, and from its
    label with weight 1 - distill. target_logits may instead be the target's top tokens (ids [T, K], log-probs
    [T, K]: dflash.train.target_topk): the distribution over those alone. With a draft vocabulary the target's
    distribution is renormalised over it."""
    counted = labels != -100
    if d.draft_vocab is None:
        keep = counted
        weight, bias = d.lm_head.weight, getattr(d.lm_head, "bias", None)
        rows = None
    else:
        # a draft vocabulary: logits over its rows only (6x less LM-head work at 8k of 49k); a label outside
        # it can never be proposed, so it counts as a miss and adds no loss
        weight, bias, rows = d._draft_head()
        index = torch.full((d.lm_head.weight.shape[0],), -1, dtype=torch.long, device=labels.device)
        index[rows.to(labels.device)] = torch.arange(len(rows), device=labels.device)
        labels = torch.where(counted, index[labels.clamp(min=0)], -100)
        keep = labels >= 0
    soft = None
    if distill:
        if target_logits is None or positions is None:
            raise ValueError("distill > 0 needs the target's logits and each row's position")
        if isinstance(target_logits, tuple):
            # the target's top tokens: their probabilities in place ([T, V'], 0 elsewhere), renormalised
            ids, logp = target_logits
            p = logp.float().exp()
            if rows is not None:
                ids = index.to(ids.device)[ids]
                p, ids = torch.where(ids >= 0, p, 0.0), ids.clamp(min=0)
            probs = p.new_zeros(p.shape[0], weight.shape[0]).scatter_add_(1, ids, p)
            probs = probs / probs.sum(-1, keepdim=True).clamp(min=torch.finfo(probs.dtype).tiny)
        else:
            t = target_logits if rows is None else target_logits[:, rows.to(target_logits.device)]
            probs = torch.softmax(t.float(), -1)
        soft = (probs, positions[keep])  # [T, V'] probabilities; each kept row's position
    w = torch.ones_like(labels, dtype=torch.float32) if weights is None else weights
    w = w[keep]
    ce_sum, predicted = _weighted_ce(hidden[keep].to(weight.dtype), weight, bias, labels[keep], w, soft, distill)
    loss = ce_sum / w.sum().clamp(min=1e-9)
    correct = torch.zeros_like(labels, dtype=torch.float32)
    correct[keep] = (predicted == labels[keep]).float()
    return loss, correct


LOGITS_AT_ONCE = 1 << 25  # logits (rows x vocabulary) made at once by the training loss: 128 MB in fp32


def _ce_rows(h, weight, bias, labels, w, probs=None, pos=None, distill=0.0):
    logits = F.linear(h, weight, bias).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    if probs is not None:
        # the gradient of -sum p log q is that of KL(p || q): p is fixed
        soft_ce = -(probs[pos] * torch.log_softmax(logits, -1)).sum(-1)
        ce = (1 - distill) * ce + distill * soft_ce
    return (ce * w).sum(), logits.argmax(-1)


def _weighted_ce(h, weight, bias, labels, w, soft=None, distill=0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """sum(w * CE) and the argmax predictions of rows h [N, H] against the head (soft: the target's probabilities
    [T, V] and each row's position in them, for distillation). Past LOGITS_AT_ONCE logits the rows go in chunks
    whose logits are made again in backward instead of kept (a full-vocabulary head over the published recipe's
    7.7k block positions would hold ~4.7 GB of logits)."""
    from torch.utils.checkpoint import checkpoint

    probs, pos = soft if soft is not None else (None, None)
    chunk = max(1, LOGITS_AT_ONCE // weight.shape[0])
    if h.shape[0] <= chunk or not torch.is_grad_enabled():
        return _ce_rows(h, weight, bias, labels, w, probs, pos, distill)
    total, predicted = h.new_zeros((), dtype=torch.float32), []
    for i in range(0, h.shape[0], chunk):
        ce, p = checkpoint(_ce_rows, h[i:i + chunk], weight, bias, labels[i:i + chunk], w[i:i + chunk], probs,
                           None if pos is None else pos[i:i + chunk], distill, use_reentrant=False)
        total = total + ce
        predicted.append(p)
    return total, torch.cat(predicted)


def block_inputs(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int,
                 mask_token_id: int):
    """Packed blocks for one sequence.

    Returns block_ids [n*B] ([x_a, MASK...] per anchor), block_pos [n*B] (a..a+B-1), labels [n, B-1]
    (x_{a+k} for slot k, -100 past the end or on unsupervised tokens).
    """
    T = input_ids.shape[0]
    B = block_size
    offs = torch.arange(B)
    pos = anchors[:, None] + offs  # [n, B]
    block_ids = torch.full((len(anchors), B), mask_token_id, dtype=torch.long)
    block_ids[:, 0] = input_ids[anchors]
    tgt = pos[:, 1:]
    inside = tgt < T
    safe = tgt.clamp(max=T - 1)
    labels = torch.where(inside & loss_mask[safe].bool(), input_ids[safe], torch.full_like(safe, -100))
    return block_ids.flatten(), pos.flatten(), labels


def check_fits(config: DFlashConfig, target) -> None:
    """Raises DFlashConfigError naming every way `config` does not fit `target`."""
    tc = target.config.get_text_config()
    problems = []
    if config.hidden_size != tc.hidden_size:
        problems.append(f"hidden size {config.hidden_size} != target hidden size {tc.hidden_size}")
    if config.num_target_layers != tc.num_hidden_layers:
        problems.append(f"draft was built for a {config.num_target_layers}-layer target, "
                        f"this target has {tc.num_hidden_layers} layers")
    bad_ids = [i for i in config.target_layer_ids if not 0 <= i < tc.num_hidden_layers]
    if bad_ids:
        problems.append(f"target_layer_ids {bad_ids} out of range 0..{tc.num_hidden_layers - 1}")
    vocab = target.get_input_embeddings().weight.shape[0]
    if not 0 <= config.mask_token_id < vocab:
        problems.append(f"mask_token_id {config.mask_token_id} outside the target vocabulary (size {vocab})")
    if problems:
        raise DFlashConfigError("draft does not fit target " + type(target).__name__ + ": " + "; ".join(problems))


def choose_mask_token_id(target, tokenizer=None) -> int:
    """A vocabulary row to use as MASK: a spare embedding row if the tokenizer leaves one, else a reserved one."""
    rows = target.get_input_embeddings().weight.shape[0]
    if tokenizer is not None:
        n = len(tokenizer)
        if rows > n:
            return n
        vocab = tokenizer.get_vocab()
        for tok in ("<|mask|>", "<mask>", "[MASK]", "<|reserved_special_token_0|>"):
            if tok in vocab and vocab[tok] < rows:
                return vocab[tok]
        # else the last added token that neither the chat template nor bos/eos/pad/unk use
        template = getattr(tokenizer, "chat_template", None) or ""
        used = set(tokenizer.all_special_ids)
        for tid, added in sorted(getattr(tokenizer, "added_tokens_decoder", {}).items(), reverse=True):
            if tid < rows and tid not in used and added.content not in template:
                return tid
    tc = target.config.get_text_config()
    pad = getattr(tc, "pad_token_id", None)
    eos = getattr(tc, "eos_token_id", None)
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
    if isinstance(pad, int) and 0 <= pad < rows and pad not in eos:
        return pad
    return rows - 1


def write_draft(directory: str | os.PathLike, state: dict[str, torch.Tensor], config: DFlashConfig) -> None:
    """A draft folder in the published format: model.safetensors (written atomically) and config.json."""
    from safetensors.torch import save_file

    from .io import atomic_path

    os.makedirs(directory, exist_ok=True)
    with atomic_path(os.path.join(directory, "model.safetensors")) as tmp:
        save_file(state, tmp, metadata={"format": "pt"})
    config.save(directory)


def _read_weights(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single = os.path.join(directory, "model.safetensors")
    index = single + ".index.json"
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        import json

        with open(index) as f:
            weight_map = json.load(f).get("weight_map") or {}
        files = [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]
        absent = [os.path.basename(f) for f in files if not os.path.isfile(f)]
        if not files or absent:
            raise DFlashConfigError(f"draft directory {directory}: its index names shards that are not there: "
                                    f"{absent or 'none'}")
    else:
        raise DFlashConfigError(f"no model.safetensors (or model.safetensors.index.json and its shards) in draft "
                                f"directory {directory}")
    state = {}
    for f in files:
        state.update(load_file(f))
    return state


def draft_folder(repo_id: str) -> str:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover
        raise DFlashConfigError(f"draft path {repo_id!r} does not exist") from None
    try:
        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors"])
    except Exception as e:
        raise DFlashConfigError(f"draft path {repo_id!r} does not exist locally and could not be fetched "
                                f"from the hub ({type(e).__name__})") from None
