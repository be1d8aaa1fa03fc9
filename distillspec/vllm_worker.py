"""Runs inside vLLM's worker processes (``worker_extension_cls``): replaces the draft's weights in place.

An engine serving a draft alone takes them into its model; an engine decoding speculatively takes them into its
``draft_model``. The weights arrive as one safetensors byte string (tensors inside ``collective_rpc`` arguments would
arrive as lists) with a checksum per tensor, checked here before anything is loaded (:mod:`distillspec.integrity`),
and load through vLLM's layer-wise reload, which re-runs each layer's post-load processing (on CPU,
linear weights are repacked after loading, so a plain ``load_weights`` leaves the kernels stale).
"""

from __future__ import annotations

import safetensors.torch
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from distillspec.integrity import mismatches


class DraftWeights:
    """Mixed into vLLM's worker class by name: ``distillspec.vllm_worker.DraftWeights``."""

    def load_draft(self, blob: bytes, sums: dict[str, str]) -> int | list[str]:
        """Load the draft's weights (HF checkpoint names) when each tensor matches its checksum in ``sums``: returns
        how many tensors the model took, or the names of the mismatching tensors (and loads nothing)."""
        tensors = safetensors.torch.load(blob)
        bad = mismatches({name: t.numpy() for name, t in tensors.items()}, sums)
        if bad:
            return bad
        runner = self.model_runner
        draft = runner.get_draft_model()
        if draft is None:  # this engine serves the draft itself
            model, model_config = runner.get_model(), self.vllm_config.model_config
        else:
            model, model_config = draft, self.vllm_config.speculative_config.draft_model_config
        initialize_layerwise_reload(model)
        loaded = model.load_weights(iter(tensors.items()))
        finalize_layerwise_reload(model, model_config)
        return len(loaded) if loaded is not None else len(tensors)
