"""An EAGLE-3-style drafter: the autoregressive peer DFlash is compared with.

One decoder layer reads, at every position j, the pair (target features f_j fused by `fc`, embedding of the
token x_{j+1} that followed) and predicts x_{j+2}. Drafting is a chain: the first proposal comes from the
last committed position; each further one feeds the draft's own output state back in place of the target's
features, so k proposals cost k sequential draft forwards (DFlash fills its whole block in one).

Training is a "training-time test": the chain is unrolled for a few steps on the draft's own states, each
step's loss weighted by `STEP_DECAY**i`, so the draft learns to predict from its own outputs as it must at
inference. The checkpoint is the DFlash one (config + safetensors) with `draft_method: eagle3`; `block_size`
is the verify width (the anchor + k chained proposals).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .kernels import Linear
from .model import DFlashDraftModel, DFlashMLP, DraftKVCache, RMSNorm, apply_rope, head_loss

STEP_DECAY = 0.8  # loss weight of unroll step i is STEP_DECAY**i


class Eagle3Attention(nn.Module):
    """Llama-style attention whose q/k/v read the concatenated [token embedding; feature] pair (2H wide)."""

    def __init__(self, config):
        super().__init__()
        h, self.num_heads, self.num_kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim ** -0.5
        bias = config.attention_bias
        self.q_proj = Linear(2 * h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(2 * h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(2 * h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias=bias)

    def _heads(self, proj, u, n_heads):
        b, n, _ = u.shape
        return proj(u).view(b, n, n_heads, self.head_dim).transpose(1, 2)

    def kv(self, u, cos, sin):
        # u: [b, n, 2H] -> k, v: [b, kv_heads, n, head_dim]
        return apply_rope(self._heads(self.k_proj, u, self.num_kv_heads), cos, sin), \
            self._heads(self.v_proj, u, self.num_kv_heads)

    def forward(self, u, cos, sin, k, v, mask):
        # u: [b, Q, 2H]; k/v: [b, kv_heads, K, head_dim] (the queries' own entries included); mask: [b, 1, Q, K]
        b, Q, _ = u.shape
        q = apply_rope(self._heads(self.q_proj, u, self.num_heads), cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                             enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, Q, -1))


class Eagle3Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # on the token embedding
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)


class Eagle3DraftModel(DFlashDraftModel):
    """`fc` fuses the tapped target layers; `hidden_norm` normalises the feature stream (target features, or
    the draft's own previous output) before it meets the token embedding; `norm` precedes the shared LM head."""

    DRAFT_METHOD = "eagle3"

    def __init__(self, config):
        super().__init__(config)
        if config.num_hidden_layers != 1:
            raise ValueError("the EAGLE-3-style drafter has exactly one layer")
        self.layers = nn.ModuleList([Eagle3Layer(config)])

    @classmethod
    def from_target(cls, target, block_size: int = 8, target_layer_ids=None, num_target_features: int | None = None,
                    **_):
        """A fresh drafter for `target` proposing block_size-1 tokens per step (by default it taps three
        layers, low/middle/high, or every layer of a shallower target)."""
        if target_layer_ids is None and num_target_features is None:
            num_target_features = min(3, target.config.get_text_config().num_hidden_layers)
        base = DFlashDraftModel.from_target(target, num_layers=1, block_size=block_size,
                                            target_layer_ids=target_layer_ids, mask_token_id=0,
                                            num_target_features=num_target_features)
        base.config.draft_method = "eagle3"
        param = next(target.parameters())
        draft = cls(base.config).to(device=param.device, dtype=param.dtype)
        draft.reset_parameters()
        with torch.no_grad():
            draft.norm.weight.copy_(base.norm.weight)  # the target's final-norm scale (see DFlashDraftModel)
        return draft.bind(target)

    # ---- pieces shared by training and inference -----------------------------------------------------
    def layer_inputs(self, stream: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """[input_layernorm(embed(x)); hidden_norm(stream)]: [b, n, 2H] from stream [b, n, H], token_ids [b, n]."""
        layer = self.layers[0]
        emb = self.embed_tokens(token_ids).to(stream.dtype)
        return torch.cat([layer.input_layernorm(emb), self.hidden_norm(stream)], -1)

    def layer_output(self, stream, u, cos, sin, k, v, mask) -> torch.Tensor:
        """The draft's output state [b, Q, H] (the next chain step's stream; `norm` + LM head give its token)."""
        layer = self.layers[0]
        h = stream + layer.self_attn(u, cos, sin, k, v, mask)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def head_argmax(self, h: torch.Tensor) -> torch.Tensor:
        """Greedy token ids [b, n] from output states h [b, n, H]."""
        return self.greedy_tokens(self.norm(h))

    # ---- inference ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self) -> None:
        """Builds the proposal head ahead of the first step; the chain runs its own layer, not the DFlash draft's
        layer stack (see DFlashDraftModel.prepare)."""
        self._proposal_head()

    def write_entries(self, features, next_ids, cache: DraftKVCache, slot: int):
        """Writes the entries of n committed positions into cache slots slot..slot+n: entry j pairs the target
        features f_j [b, n, F] with the token that followed, next_ids [b, n] (positions already in the cache).
        Returns (stream [b, n, H], u [b, n, 2H]) so the caller can query from the last committed entry."""
        n = features.shape[1]
        stream = self.fc(features.to(self.fc.weight.dtype))
        u = self.layer_inputs(stream, next_ids)
        cos, sin = self.rotary_emb(u, cache.positions[:, slot:slot + n])
        k, v = self.layers[0].self_attn.kv(u, cos, sin)
        cache.keys[0, :, :, slot:slot + n] = k
        cache.values[0, :, :, slot:slot + n] = v
        return stream, u

    @torch.no_grad()
    def chain(self, stream, u, pos, cache: DraftKVCache, ctx_valid, k: int) -> torch.Tensor:
        """k greedy proposals [b, k], one draft forward each.

        stream [b, H], u [b, 2H], pos [b]: each row's last committed entry (already in the cache) and its
        position; ctx_valid [b, T]: the committed cache slots. Proposal i's entry is written at scratch slot
        T+i-1 (past every row's committed slots; the next commit overwrites it)."""
        b, T = ctx_valid.shape
        attn = self.layers[0].self_attn
        stream, u, pos = stream[:, None], u[:, None], pos[:, None]
        visible = ctx_valid
        tokens = []
        for i in range(k):
            if i > 0:  # the draft's own output and proposal become the next entry
                u, pos = self.layer_inputs(stream, tokens[-1]), pos + 1
            cos, sin = self.rotary_emb(u, pos)
            if i > 0:
                cache.keys[0, :, :, T + i - 1:T + i], cache.values[0, :, :, T + i - 1:T + i] = attn.kv(u, cos, sin)
                visible = torch.cat([visible, visible.new_ones(b, 1)], 1)
            n = visible.shape[1]
            stream = self.layer_output(stream, u, cos, sin, cache.keys[0, :, :, :n], cache.values[0, :, :, :n],
                                       visible[:, None, None])
            tokens.append(self.head_argmax(stream))
        return torch.cat(tokens, 1)


def ttt_masks(n: int, steps: int, device) -> list[torch.Tensor]:
    """Attention masks of the unrolled chain over n entries: step i's query j sees step-0 entries 0..j (the
    committed context) and entry j of steps 1..i (its own chain). masks[i]: [n, (i+1)*n] bool."""
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    eye = torch.eye(n, dtype=torch.bool, device=device)
    return [torch.cat([causal] + [eye] * i, 1) for i in range(steps)]


class Eagle3TrainStep(nn.Module):
    """Training-time-test loss of one sequence (a module so DistributedDataParallel can wrap it)."""

    def __init__(self, draft: Eagle3DraftModel, steps: int):
        super().__init__()
        self.draft, self.steps = draft, steps

    def unrolled(self, features, input_ids) -> list[torch.Tensor]:
        """The chain unrolled over a whole sequence: features [T, F], input_ids [T] -> per step i the output
        states [n, H] of entries j = 0..n-1 (n = T-1). Entry j = (f_j, x_{j+1}) at position j; step i feeds
        it x_{j+1+i} with the previous step's state and predicts x_{j+2+i}."""
        d = self.draft
        T = input_ids.shape[0]
        n = T - 1
        dev = features.device
        ids = input_ids.to(dev)
        stream = d.fc(features[None, :n].to(d.fc.weight.dtype))  # [1, n, H]
        attn = d.layers[0].self_attn
        masks = ttt_masks(n, self.steps, dev)
        j = torch.arange(n, device=dev)
        keys, values, out = [], [], []
        for i in range(self.steps):
            u = d.layer_inputs(stream, ids[(j + 1 + i).clamp(max=T - 1)][None])
            cos, sin = d.rotary_emb(u, (j + i)[None])
            k, v = attn.kv(u, cos, sin)
            keys.append(k)
            values.append(v)
            stream = d.layer_output(stream, u, cos, sin, torch.cat(keys, 2), torch.cat(values, 2),
                                    masks[i][None, None])
            out.append(stream[0])
        return out

    def forward(self, features, input_ids, loss_mask, anchors=None):
        """features [T, F], input_ids [T], loss_mask [T] -> (weighted loss, (correct, counted) per step).
        With anchors [m] (positions of committed tokens), only the chains that start at them are scored: the
        chain after anchor a starts from entry a-1 (the LM head, most of the cost, then runs on m rows)."""
        d = self.draft
        T = input_ids.shape[0]
        dev = features.device
        ids, lm = input_ids.to(dev), loss_mask.to(dev).bool()
        j = torch.arange(T - 1, device=dev) if anchors is None else (anchors.to(dev) - 1).clamp(min=0)
        total, weight_sum = 0.0, 0.0
        correct = torch.zeros(self.steps, device=dev)
        counted = torch.zeros(self.steps, device=dev)
        for i, stream in enumerate(self.unrolled(features, input_ids)):
            at = j + 2 + i  # the label's position
            ok = (at < T) & lm[at.clamp(max=T - 1)]
            if not ok.any():
                continue
            loss, hit = head_loss(d, d.norm(stream[j]), torch.where(ok, ids[at.clamp(max=T - 1)], -100))
            w = STEP_DECAY ** i
            total = total + w * loss
            weight_sum += w
            correct[i] = hit.sum()
            counted[i] = ok.float().sum()
        if weight_sum == 0:
            return sum(p.sum() * 0 for p in d.parameters() if p.requires_grad), (correct, counted)
        return total / weight_sum, (correct, counted)
