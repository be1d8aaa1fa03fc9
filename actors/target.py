"""The target's weights, shared on each node: a run loads them once (:func:`share_target`, before its actors start)
and every actor that holds the target (the scoring actors, rollout actors that sample the target, a learner that
scores, the evaluator, the Serve replicas that follow the run) builds it over that one copy in Ray's object store
(:func:`shared_target`), instead of reading its own from disk: one target's memory per node, not one per actor.

An actor on another node makes Ray copy the object there once; its neighbours on that node read that copy. A
bfloat16 target that decodes through the few-row kernel (``prepack``, a CPU with AVX512-BF16) is shared in that
layout too, so that the actors that decode with it read one more copy a node, not one each; with ``prepack=int4`` its
layers on 4-bit grids are shared in 4 bits, found once on the file's values (with ``prepack=int4-int8`` too, whose
other layers each actor rounds to int8 itself).
"""

from __future__ import annotations

import ray
from transformers import PreTrainedModel

from actors.common import NAMESPACE, log, weights_name
from actors.worker import setup_worker
from distillspec.config import Models
from distillspec.models.loading import (
    INT4_PREPACKS,
    SharedWeights,
    file_weights,
    load_model,
    resolve_dtype,
    resolve_prepack,
    share_weights,
)
from distillspec.models.packing import grid_layouts


@ray.remote(num_cpus=0, max_calls=1)  # its process goes when it returns, and the memory it loaded with
def _load_shared(models: Models) -> SharedWeights:
    setup_worker()
    dtype = resolve_dtype(models.dtype, models.target, models.device)[0]
    prepack = resolve_prepack(models.prepack, dtype, models.target, models.device)[0]
    model, _ = load_model(models.target, device=models.device, dtype=dtype)
    # with prepack=int4 its layers on 4-bit grids, found on the file's values, are shared in 4 bits beside the weights
    int4 = grid_layouts(model, file_weights(models.target)) if prepack in INT4_PREPACKS else {}
    # a bfloat16 target that decodes through the few-row kernel: its layout is shared too, once a node
    layouts = dtype == "bfloat16" and prepack in (True, "int4")
    return share_weights(model, models.target, layouts=layouts, int4=int4)


def share_target(models: Models) -> list[ray.ObjectRef] | None:
    """``[a reference]`` to the target's weights, being put into the object store by a task (owned by the caller:
    they live as long as it does), for the run's weight store to hand out; None where each actor holds its own: on
    an accelerator, or with prepacked float32 weights (each process packs its own copy)."""
    if models.device != "cpu":
        return None
    dtype = resolve_dtype(models.dtype, models.target, models.device)[0]
    if dtype == "float32" and resolve_prepack(models.prepack, dtype, models.target, models.device)[0]:
        return None
    return [_load_shared.remote(models)]


def shared_target(run: str) -> SharedWeights | None:
    """The target's weights that run ``run`` shares (:func:`share_target`), read in place; None when the run shares
    none, is not up, or its driver (their owner) is gone."""
    try:
        store = ray.get_actor(weights_name(run), namespace=NAMESPACE)
        refs = ray.get(store.shared_target.remote())
        return ray.get(refs[0]) if refs else None
    except (ValueError, ray.exceptions.RayActorError):  # no such run, or it is ending
        return None
    except ray.exceptions.ObjectLostError:  # the run's driver died: load the target from disk
        log.warning("the target shared by run %s is gone with its driver: loading it from disk", run)
    except ray.exceptions.RayTaskError as exc:  # loading it failed there: loading it here says why
        log.warning("the run %s could not share its target (%s): loading it from disk", run, exc.cause)
    return None


def load_target(models: Models, run: str, device: str | None = None, *, scores_only: bool = False) -> PreTrainedModel:
    """The frozen target of an actor of run ``run``, on ``device`` (default ``models.device``): built over the
    weights the run shares (:func:`shared_target`), else read from disk. ``scores_only``: a target that scores
    batches of many rows and never decodes (a learner's, a scoring actor's) keeps oneDNN's layout where its float32
    weights are prepacked (with ``prepack=bfloat16`` too: its float32 weights), whose GEMM was faster than the
    few-row kernel's for a prompt's 128 rows."""
    device = device or models.device
    kernel = "onednn" if scores_only else "auto"
    shared = shared_target(run)
    return load_model(
        models.target, device=device, dtype=models.dtype, prepack=models.prepack, shared=shared, kernel=kernel
    )[0]
