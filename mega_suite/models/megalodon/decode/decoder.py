"""Decoding a Megalodon language model: the one-token path from packed weights, and generation.

    dec = Decoder(model)                                    # float32 packs; Decoder(model, torch.bfloat16) ...
    logits, cache = dec(prompt, model.new_cache(batch))     # a segment: the model's streaming pass
    logits, cache = dec(next_tokens[:, None], cache)        # one token: five packed GEMVs per block
    out = generate(dec, prompt, max_new_tokens=64, top_p=0.9)     # decode/generation.py

The decoder reads the model (its embedding, its cache types, its parameters through the packs); the model
knows nothing of it. Any split of a stream into segments and single tokens gives the full pass's logits.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mega_suite.models.megalodon.cache import StreamingCache
from mega_suite.models.megalodon.pack import DecodePlan, check_decode_options, parameters_may_have_changed
from mega_suite.models.megalodon.step import MODEL_PLAN, can_step, model_plan, stream_step


class Decoder:
    """One-token decoding of ``model`` (a ``MegalodonLM``) with packed weights.

    ``dtype``: the packs' weight dtype, float32 (None), torch.bfloat16 or torch.int8 (weight-only, per-row
    scales); ``gemv``: "matmul" (BLAS), "rows" (``torch.mv`` over W [O, I]) or "mkldnn" (oneDNN, CPU);
    ``kv_dtype``: the dtype the unfinished chunk's keys and values are kept in while decoding (None: as
    computed). Activations, CEMA, every norm's statistics and the logits stay float32
    (docs/long_context.md#the-one-token-step).
    """

    def __init__(
        self,
        model: nn.Module,
        dtype: torch.dtype | None = None,
        gemv: str = "matmul",
        kv_dtype: torch.dtype | None = None,
    ):
        self.model = model
        self._plan: DecodePlan | None = None
        self.set_weights(dtype, gemv, kv_dtype)

    @torch.no_grad()
    def set_weights(
        self, dtype: torch.dtype | None, gemv: str = "matmul", kv_dtype: torch.dtype | None = None
    ) -> Decoder:
        """Choose the packs' dtype, GEMV kind and key / value dtype (checked at once); returns ``self``."""
        dtype = torch.float32 if dtype is None else dtype
        check_decode_options(dtype, gemv, self.model.output.final_norm.weight.device, kv_dtype)
        self.options = (dtype, gemv, kv_dtype)
        self._plan = None
        return self

    @torch.no_grad()
    def plan(self, kind: str | None = None) -> DecodePlan:
        """The packed weights, rebuilt if any parameter changed since they were packed (training,
        ``load_state_dict``, ``to``; see ``DecodePlan.is_current``). ``kind``: a GEMV kind to pack for other
        than the decoder's own (the compiled CPU ``StaticDecoder`` asks for "rows"); the last plan is kept."""
        dtype, gemv, kv_dtype = self.options
        options = (dtype, gemv if kind is None else kind, kv_dtype)
        if options == MODEL_PLAN:  # the default packs: the model's own, shared with its forward
            return model_plan(self.model)
        plan = self._plan
        if plan is None or not plan.is_current(self.model, *options):
            plan = self._plan = DecodePlan(self.model, *options)
        return plan

    def can_step(self) -> bool:
        """The one-token path applies: no autograd, a float32 model (float64 ones keep the streaming pass),
        token embeddings (not the adaptive input) and unsharded blocks (the step bypasses FSDP2's hooks)."""
        return can_step(self.model)

    def __call__(self, tokens: Tensor, cache: StreamingCache | None = None) -> tuple[Tensor, StreamingCache]:
        """tokens [B, L] -> (logits [B, L, V] float32, cache): one token through the packed step where it
        applies, any other segment through the model's streaming pass."""
        if cache is not None and tokens.dim() == 2 and tokens.shape[1] == 1 and self.can_step():
            plan = self.plan()
            x, cache = stream_step(self.model, plan, tokens[:, 0], cache)
            with torch.autocast(tokens.device.type, enabled=False):  # float32 logits
                return plan.head(x).unsqueeze(1), cache
        parameters_may_have_changed()  # a full pass: every plan re-lists the parameter objects once
        return self.model(tokens, cache, use_cache=True)

    def step_hidden(self, tokens: Tensor, cache: StreamingCache) -> tuple[Tensor, StreamingCache]:
        """tokens [B] at ``cache.position`` -> (final normalised hidden states [B, D], cache). Autocast is off:
        the plan's weight dtype decides the GEMVs' precision, everything else is float32."""
        return stream_step(self.model, self.plan(), tokens, cache)
