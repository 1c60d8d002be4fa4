"""Ghost clipping of tied input/output embeddings: one ``nn.Embedding`` whose weight W [V, d] is also the weight of an
output ``nn.Linear`` (GPT-2's ``lm_head.weight is transformer.wte.weight``; Llama and others with
``tie_word_embeddings=True``). Supported **exactly**.

Per example the tied weight's gradient is the sum of its two uses, G = G_e + G_h, with the embedding's sparse
G_e = Σ_t onehot(x_t) g_tᵀ (g_t ∈ R^d the embedding output's gradient at token x_t) and the head's
G_h = Σ_s g'_s a_sᵀ (a_s ∈ R^d its input, g'_s ∈ R^V its output gradient). So

    ‖G‖² = ‖G_e‖² + ‖G_h‖² + 2⟨G_e, G_h⟩,    ⟨G_e, G_h⟩ = Σ_t Σ_s g'_s[x_t] (g_t · a_s),

where the first two terms are those of :mod:`hf_dp.clipping.embedding` and :mod:`hf_dp.clipping.linear` (called on
each use's records) and the cross term costs one [T_e, T_h] matrix per example (a gather of g' at the input ids and a
batched matmul: O(T_e·T_h·d), like a Gram product). The clipped sum is the sum of the two uses' clipped sums. With a
rule's per-sample affine map (o, s) on W (DP-SGD-L2, DP-MacAdam): ‖(G + o) ⊙ s‖² = ‖G_e⊙s‖² (+ the embedding's offset
terms 2⟨G_e, o⊙s²⟩ + ‖o⊙s‖²) + ‖G_h⊙s‖² + 2⟨G_h, o⊙s²⟩ + 2⟨G_e⊙s, G_h⊙s⟩, the last with g_t ⊙ s²[x_t] in place of
g_t. Both engines record the two uses in one :class:`~hf_dp.clipping.registry.Layer` (records tagged ``"emb"`` /
``"head"``), so the non-finite re-check, the regrouping by privacy unit and two passes apply to the pair as to any
layer. Any other sharing of a parameter between modules is refused (:func:`tie_of`): use ``--clipping hooks``, whose
Opacus per-sample gradients add up every use of a parameter.
"""

from __future__ import annotations

import torch
from torch import nn

from .common import TINY32, affine_of, as_3d, cat_records, gamma, row_norms64, unit_roundoff
from .embedding import EmbeddingType
from .linear import LinearType
from .registry import GhostLayerType, Layer, layer_type_for

__all__ = ["TiedEmbeddingType", "tie_of"]


def tie_of(users: list) -> tuple:
    """(embedding name, head name, :class:`TiedEmbeddingType`) for a parameter used by the modules ``users``
    [(name, module), …]; ``ValueError`` unless they are an ``nn.Embedding`` and an ``nn.Linear`` whose weight is the
    embedding's weight."""
    names = " and ".join(n for n, _ in users)
    if len(users) == 2:
        (n1, m1), (n2, m2) = users
        if isinstance(m2, nn.Embedding) and not isinstance(m1, nn.Embedding):
            (n1, m1), (n2, m2) = (n2, m2), (n1, m1)
        emb_type, head_type = layer_type_for(m1), layer_type_for(m2)
        if (isinstance(m1, nn.Embedding) and type(emb_type) is EmbeddingType and isinstance(m2, nn.Linear)
                and type(head_type) is LinearType and m2.weight is m1.weight):
            return n1, n2, TiedEmbeddingType(m2, emb_type, head_type)
    raise ValueError(
        f"ghost clipping cannot handle parameters shared between modules ({names}): only an nn.Embedding whose weight "
        "is also an nn.Linear's weight (tied input/output embeddings) is supported; use --clipping hooks"
    )


class _Tagged:
    """An ``append``-only view of a records list that tags every record with the member it comes from."""

    def __init__(self, target: list, tag: str):
        self.target, self.tag = target, tag

    def append(self, record: tuple) -> None:
        self.target.append((*record, self.tag))


class TiedEmbeddingType(GhostLayerType):
    """One entry for an embedding and the output linear layer sharing its weight (see the module docstring); made by
    :func:`tie_of`, not registered."""

    name = "tied_embedding"
    record_tags = ("emb", "head")

    def __init__(self, head: nn.Linear = None, emb_type: EmbeddingType = None, head_type: LinearType = None):
        self.head = head
        self.emb_type = emb_type or EmbeddingType()
        self.head_type = head_type or LinearType()

    def check(self, module, name):
        self.emb_type.check(module, name)

    def members(self, module):
        return [module, self.head]

    def instrument(self, layer) -> list:
        emb, head = Layer(layer.module, self.emb_type), Layer(self.head, self.head_type)
        emb.records, head.records = _Tagged(layer.records, "emb"), _Tagged(layer.records, "head")
        emb.state = head.state = layer.state  # paused with the pair
        return self.emb_type.instrument(emb) + self.head_type.instrument(head)

    def terms(self, layer, scale, affine, dt, work):
        m, head = layer.module, self.head
        w = m.weight
        emb, lin = Layer(m, self.emb_type), Layer(head, self.head_type)
        emb.records = [r[:2] for r in layer.records if r[-1] == "emb"]
        lin.records = [(r[0], r[1], r[2] if len(r) == 4 else None) for r in layer.records if r[-1] == "head"]
        if not emb.records or not lin.records:
            missing = "embedding" if not emb.records else "output layer"
            raise ValueError(f"the tied {missing} ({type(m).__name__} weight) recorded no backward pass; is it used in the forward?")
        o, sc = affine_of(affine, w, dtype=dt)
        # the embedding's own terms carry the offset's ‖o ⊙ s‖² and 2⟨G_e, o ⊙ s²⟩; the head's get only the scale
        sq_e, clipped_e = self.emb_type.terms(emb, scale, {w: affine[w]} if w in affine else {}, dt, work)
        head_affine = {p: v for p, v in affine.items() if p is not w}
        if sc is not None:
            head_affine[w] = (None, sc)
        sq_h, clipped_h = self.head_type.terms(lin, scale, head_affine, dt, work)

        ids = torch.cat([r[0].reshape(r[0].shape[0], -1) for r in emb.records], dim=1)  # [B, Te]
        ge = torch.cat([as_3d(r[1].to(dt) / scale) for r in emb.records], dim=1)  # [B, Te, d]
        if m.padding_idx is not None:
            ge = ge * (ids != m.padding_idx).unsqueeze(-1)
        a, gh = cat_records(lin.records, scale, dt)  # [B, Th, d], [B, Th, V]
        a = a.to(dt)
        s2 = sc * sc if isinstance(sc, float) else 1.0
        if torch.is_tensor(sc):
            ge = ge * sc.pow(2)[ids]  # g_t ⊙ s²[x_t]
        B, Te = ids.shape
        gx = torch.gather(gh, 2, ids.unsqueeze(1).expand(B, gh.shape[1], Te))  # [B, Th, Te]: g'_s[x_t]
        # Σ_{s,t} g'_s[x_t] (a_s · g_t s²), the float32 products a_s·g_t off by ≤ γ_d‖a_s‖‖g_t‖ + 2d·2^-149 each: the
        # cross term is raised by that bound (so the sum of the three terms stays an upper bound of ‖G_i‖²)
        d = a.shape[-1]
        gx64 = gx.double()
        cross = (torch.bmm(a, ge.transpose(1, 2)).double() * gx64).sum((1, 2))
        na, ne = row_norms64(a), row_norms64(ge)
        tiny = 2.0**-1074 if dt == torch.float64 else TINY32
        err = gamma(d, unit_roundoff(dt)) * (torch.bmm(na.unsqueeze(1), gx64.abs()).squeeze(1) * ne).sum(1) + 2 * d * tiny * gx64.abs().sum((1, 2))
        cross = cross + err * (1 + 2.0**-40)
        sq = sq_e + sq_h + 2 * s2 * cross
        if o is not None:  # 2⟨G_h, o ⊙ s²⟩ = 2 Σ_s g'_s · ((o ⊙ s²) a_s)
            os2 = o * (sc.pow(2) if torch.is_tensor(sc) else s2)
            sq = sq + 2 * (torch.matmul(a, os2.t()) * gh).sum((1, 2))

        def clipped(c):
            out = clipped_h(c)
            out[w] = (out[w].to(dt) + clipped_e(c)[w].to(dt)).to(w.dtype)
            return out

        return sq, clipped
