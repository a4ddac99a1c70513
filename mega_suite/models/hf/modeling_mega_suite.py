"""transformers wrapper of a mega-suite language model (Megalodon or the Llama baseline): the suite model as
``.model``, logits from its full pass. ``generate()`` recomputes the prefix at every token (no key / value
cache); ``python run.py mode=generate`` is the streaming path. Rows of a batch must have the same length
(no padding mask)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_mega_suite import MegaSuiteConfig


class MegaSuiteForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MegaSuiteConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: MegaSuiteConfig):
        super().__init__(config)
        from mega_suite.models.bundle import FORMAT, config_from_dict
        from mega_suite.models.registry import build_model

        raw = {"mega_suite_format": FORMAT, "arch": config.arch, "suite_config": config.suite_config}
        self.model = build_model(config_from_dict(raw))
        self._tied_weights_keys = dict(config.tied_weights) or None
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # no transformers cache: each step recomputes the prefix

    def _init_weights(self, module) -> None:
        pass  # the suite model initialises itself in its constructor; from_pretrained then loads the weights

    def get_input_embeddings(self):
        return self.model.embed

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs) -> CausalLMOutputWithPast:
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("mega-suite models take no padding mask: give rows of the same length")
        window = getattr(self.model.cfg, "max_seq_len", None)
        long = window is not None and input_ids.shape[1] > window  # Llama beyond its window: sliding window
        logits = self.model(input_ids, use_cache=long)[0]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    @torch.no_grad()
    def suite_model(self):
        """The wrapped mega-suite model (``MegalodonLM`` or ``LlamaLM``)."""
        return self.model
