"""Prompts that start as earlier ones did are read after the blocks a prompt cache holds of them, to the same logits
and the same text."""

import gc

import torch

from distillspec import autoregressive_generate, speculative_generate
from distillspec.decoding.kvcache import CachedLM
from distillspec.decoding.prompt_cache import BLOCK, PromptCache, block_names
from distillspec.models.loading import encode_prompts, pad_prompts

from .test_kvcache import tiny_qwen2


def test_a_block_is_named_by_its_tokens_and_every_token_before_it():
    a, b = list(range(40)), list(range(40))
    b[3] = 99
    assert len(block_names(a)) == 40 // BLOCK == 2
    assert block_names(a) == block_names(a[:39]) != block_names(b)
    assert block_names(a)[1] != block_names(b)[1]  # the same tokens after another first block: another block


def test_prompts_that_start_alike_read_only_their_rest_to_the_logits_of_whole_reads():
    torch.manual_seed(0)
    model = tiny_qwen2()
    shared = torch.randint(1, 40, (35,)).tolist()
    # left-padded rows: two blocks held, three (the second row's third block is its own), and one that shares none
    rows = [shared + [3, 4, 5], shared[:32] + [7] * 18, torch.randint(1, 40, (20,)).tolist()]
    ids, mask = pad_prompts(rows, 0)
    whole = CachedLM(model)
    expected = [whole.prefill(ids, mask), whole.step(torch.tensor([[5], [6], [7]]))]

    cache = PromptCache(1 << 20)
    first = CachedLM(model, prompts=cache)
    assert torch.equal(first.prefill(ids, mask), expected[0])  # nothing held yet: read as without the cache
    assert len(cache) == 2 + 1 + 1 and cache.hits == 0  # whole blocks only: the shared two, the second row's third,
    # the third row's first

    again = CachedLM(model, prompts=cache)
    got = [again.prefill(ids, mask), again.step(torch.tensor([[5], [6], [7]]))]
    assert cache.hits == 2 * BLOCK + 3 * BLOCK + 1 * BLOCK  # at most all but a row's last token is found
    assert again.mask[0].tolist()[: 2 * BLOCK + 1] == [1] * (2 * BLOCK) + [0]  # its blocks, then holes, then the rest
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    assert torch.equal(again.next_pos, whole.next_pos)


def test_decoders_with_a_prompt_cache_give_the_tokens_they_give_without_one(text_pair, tokenizer, task):
    target, draft = text_pair
    preamble = "Answer with a number. " * 6  # a shared first part of several blocks
    ids, mask = encode_prompts(tokenizer, [preamble + e.prompt for e in task.test[:3]])
    common = dict(max_new_tokens=12, temperature=0.0, attention_mask=mask, eos_token_id=tokenizer.eos_token_id)
    expected = speculative_generate(target, draft, ids, gamma=3, **common).sequences
    alone = autoregressive_generate(target, ids, **common).sequences
    cache = PromptCache(64 << 20)
    for _ in range(2):  # the second time the blocks are held
        assert torch.equal(speculative_generate(target, draft, ids, gamma=3, prompt_cache=cache, **common).sequences,
                           expected)  # fmt: skip
        assert torch.equal(autoregressive_generate(target, ids, prompt_cache=cache, **common).sequences, alone)
    # held: the preamble's whole blocks (its last token may merge with the question's first), for each of 3 rows
    # in 4 calls: the second time through, the target's alone and speculative decoding's two models; before it, the
    # target alone after speculative decoding's target
    held = (len(tokenizer(preamble)["input_ids"]) - 1) // BLOCK * BLOCK
    assert held >= 2 * BLOCK and cache.hits >= 4 * 3 * held


def test_the_cache_holds_at_most_its_bytes_least_recently_used_out_first_and_a_models_blocks_go_with_it():
    models = [tiny_qwen2(seed) for seed in range(2)]
    tokens = list(range(1, 1 + 3 * BLOCK))
    keys = torch.randn(2, 2, len(tokens), 8)
    size = 2 * keys[:, :, :BLOCK].nbytes  # a block's keys and values
    cache = PromptCache(4 * size)
    cache.add(models[0], tokens, keys, keys)
    assert len(cache) == 3 and cache.bytes == 3 * size
    assert len(cache.find(models[1], tokens)) == 0  # another model's blocks are not its own
    found = cache.find(models[0], tokens)
    assert len(found) == 2 and torch.equal(found[1][0], keys[:, :, BLOCK : 2 * BLOCK])  # all but the last token's
    cache.add(models[1], tokens[:BLOCK], keys, keys)
    cache.add(models[1], [9] + tokens[1:BLOCK], keys, keys)  # over the budget: the least recently used goes
    assert cache.bytes == 4 * size and len(cache.find(models[0], tokens)) == 2
    del models[1], found
    gc.collect()
    assert len(cache) == 2 and cache.bytes == 2 * size
