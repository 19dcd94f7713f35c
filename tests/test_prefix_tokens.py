"""Prefix reuse in the gateway's tokenizer (``wire.prefix_tokens``): a prompt that extends a
recent one must get exactly the ids of encoding it whole, with real tokenizers of the shapes
models ship (byte-level BPE as Llama 3 and Qwen, Metaspace and the Llama 2 "legacy" prepend
as sentencepiece conversions), while most of its tokens come from the cache."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.tiny_tokenizer import TEMPLATES, build
from tests.requires import need
from wire.prefix_tokens import PrefixTokens, anchor_tokens
from wire.hashing import uint32_le
from wire.tokenizer import HFTokenizer

tokenizers = need("tokenizers", "pip extra 'test'")

SPECIALS = ["<s>", "</s>", "[INST]", "[/INST]", "<x>"]
_WORDS = ["the", "cache", "routing", "prefix", "engine", "token", "über", "naïve", "数据", "🙂", "a", "\n", "  "]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: build(root / name, name) for name in TEMPLATES}


def _corpus():
    for i in range(300):
        yield " ".join(_WORDS[(i * 7 + j) % len(_WORDS)] for j in range(40))


def _sentencepiece_like(kind: str):
    """A BPE model with Mistral's instruction tokens, split as sentencepiece conversions split:
    ``metaspace`` (Metaspace pre-tokenizer, prepend_scheme "first"), ``legacy`` (Llama 2's
    Prepend + Replace normalizer, no pre-tokenizer), ``bytelevel`` (prefix space added)."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=kind != "bytelevel"))
    if kind == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    elif kind == "legacy":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet() if kind == "bytelevel" else []
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"], initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_special_tokens([AddedToken(t, single_word=t == "<x>", normalized=False) for t in SPECIALS])
    return tok


@pytest.fixture(scope="module")
def spm():
    return {kind: _sentencepiece_like(kind) for kind in ("metaspace", "legacy", "bytelevel")}


def _mistral_template(tmp_path: Path) -> str:
    path = tmp_path / "mistral.jinja"
    path.write_text("{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]</s>{% endfor %}")
    return str(path)


def _whole(tok):
    return lambda text: tok.encode(text, add_special_tokens=False).ids


_text = st.lists(st.sampled_from(_WORDS + [" ", "x", "[INST]", "</s>", "<s>"]), max_size=30).map(" ".join)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": _text})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.lists(_message, min_size=1, max_size=3), min_size=2, max_size=6),
       edit=st.integers(0, 5), template=st.sampled_from(sorted(TEMPLATES)))
def test_a_chat_turn_by_turn_gets_the_whole_encodings_ids(models, turns, edit, template):
    """Each turn adds messages to the last; one turn rewrites an earlier message (a client that
    trims or edits history), so reuse must stop at the last cut both prompts share."""
    reusing = HFTokenizer(str(models[template]))
    whole = HFTokenizer(str(models[template]), reuse_bytes=0)
    reusing.reuse.min_chars = 0
    system = {"role": "system", "content": "You are a careful assistant. " * 4}
    messages: list[dict] = [system]
    for n, added in enumerate(turns):
        messages = messages + added
        if n == edit and len(messages) > 2:
            messages[1] = {**messages[1], "content": messages[1]["content"] + " edited"}
        prompt = whole.render_chat(messages)
        for got, want in ((reusing.encode_chat_packed(prompt), whole.encode_chat(prompt)),
                          (reusing.encode_packed(prompt.text), whole.encode(prompt.text))):  # a text prompt: BOS
            assert got[0] == want
            assert got[1] is None or got[1] == uint32_le(want)  # packed for the precise index, where it was
    stats = reusing.reuse.stats()
    assert stats["tokenize_prefix_enabled"] == 1 and stats["tokenize_prefix_reuses_total"] > 0, stats


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(_text, min_size=2, max_size=8), kind=st.sampled_from(["metaspace", "legacy", "bytelevel"]),
       data=st.data())
def test_sentencepiece_style_splits_reuse_exactly(spm, parts, kind, data):
    """Mistral-style prompts grown a turn at a time, and others branching off an earlier turn."""
    tok = spm[kind]
    anchors = anchor_tokens(tok.get_added_tokens_decoder(), SPECIALS)
    assert "<x>" not in anchors and "[INST]" in anchors  # single_word tokens are never cuts
    reuse = PrefixTokens(_whole(tok), anchors, min_chars=0)
    prompts = []
    text = "<s>"
    for part in parts:
        text += f"[INST] {part} [/INST]{part[::-1]}</s>"
        prompts.append(text)
    for _ in range(3):  # branches: an earlier turn, then something else
        base = data.draw(st.sampled_from(prompts))
        prompts.append(base + data.draw(_text) + "[INST] again [/INST]")
    for text in prompts:
        assert reuse.encode(text) == _whole(tok)(text)
    assert reuse.enabled and reuse.reuses > 0


def test_a_cut_the_tokenizer_does_not_always_split_at_is_caught(spm, caplog):
    """``<x>`` is single_word: it is a token only between word boundaries, so the text before it
    decides whether it splits. Forced in as a cut, the first prompt's ids line up wrongly and
    the first reuse is checked against the whole encoding: reuse turns itself off, and every
    answer, that one included, is still the whole encoding's."""
    tok = spm["bytelevel"]
    whole = _whole(tok)
    reuse = PrefixTokens(whole, {"<x>": tok.token_to_id("<x>")}, min_chars=0)
    first = "engine<x> cache <x> token routing"  # the first <x> is glued to a word: not a token
    second = "engine<x> prefix"
    assert whole(first).count(tok.token_to_id("<x>")) == 1
    with caplog.at_level(logging.WARNING, logger="kvgate.tokenizer"):
        assert reuse.encode(first) == whole(first)
        assert reuse.encode(second) == whole(second)
    assert not reuse.enabled and reuse.verified == 1 and reuse.stats()["tokenize_prefix_entries"] == 0
    assert "prefix reuse is off" in caplog.text
    assert reuse.encode(second + " more") == whole(second + " more")


def test_a_conversation_keeps_one_entry_and_the_budget_holds(models):
    tok = HFTokenizer(str(models["llama3"]), reuse_bytes=15_000)
    whole = HFTokenizer(str(models["llama3"]), reuse_bytes=0)
    reuse = tok.reuse
    reuse.min_chars = 0
    seen_bytes = []
    for conv in range(6):
        messages = [{"role": "system", "content": f"conversation {conv} " * 20}]
        for turn in range(8):
            messages += [{"role": "user", "content": f"question {turn} " * 15}]
            prompt = whole.render_chat(messages)
            assert tok.encode_chat(prompt) == whole.encode_chat(prompt)
            messages += [{"role": "assistant", "content": f"answer {turn} " * 15}]
            seen_bytes.append(reuse.bytes)
        if conv == 0:  # each turn took over the one before: one entry, not eight
            assert len(reuse._lru) == 1
    assert max(seen_bytes) <= 15_000 and len(reuse._lru) < 4  # older conversations evicted
    assert reuse.reused_tokens > 3 * reuse.encoded_tokens  # most tokens came from the cache (~3.8x here)
    assert all(got[0] in reuse._lru.values() for got in reuse._keys.values())


def test_text_prompts_reuse_only_where_special_tokens_add_a_prefix(tmp_path, spm):
    """A post-processor that appends (``</s>`` after the text) cannot be reused around; one that
    only prepends (BOS) can."""
    from tokenizers import processors

    tok = spm["metaspace"]
    for name, single, prefix in (("bos", "<s> $A", True), ("bos-eos", "<s> $A </s>", False)):
        tok.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=[(t, tok.token_to_id(t)) for t in ("<s>", "</s>")])
        path = tmp_path / f"{name}.json"
        tok.save(str(path))
        ours = HFTokenizer(str(path), chat_template=_mistral_template(tmp_path))
        ours.reuse.min_chars = 0
        assert (ours._added_first is not None) == prefix
        for n in range(3):
            text = "[INST] naïve cache [/INST]" * (n + 1)
            assert ours.encode(text) == tok.encode(text).ids
        assert (ours.reuse.reuses > 0) == prefix


def test_prompts_encoded_on_the_pool_at_once_are_all_exact(models):
    from gateway.encoding import PromptEncoder

    tok = HFTokenizer(str(models["chatml"]))
    whole = HFTokenizer(str(models["chatml"]), reuse_bytes=0)
    encoder = PromptEncoder(tok, inline_chars=0, threads=4)
    prompts = []
    for conv in range(4):
        messages = [{"role": "system", "content": "shared system prompt " * 30}]
        for turn in range(6):
            messages = messages + [{"role": "user", "content": f"c{conv} t{turn} " * 40}]
            prompts.append(whole.render_chat(messages))

    async def run():
        return await asyncio.gather(*(encoder.chat(p) for p in prompts))

    try:
        got = asyncio.run(run())
    finally:
        encoder.close()
    assert [ids for ids, _ in got] == [whole.encode_chat(p) for p in prompts]
    assert all(packed is None or packed == uint32_le(ids) for ids, packed in got)
    assert sum(packed is not None for _, packed in got) >= len(got) - 4  # all but the shortest: packed
    assert encoder.stats()["tokenize_prefix_reuses_total"] > 0


def test_reuse_needs_a_template_and_a_tokenizer_that_does_not_truncate(tmp_path, spm):
    tok = spm["legacy"]
    plain, truncating = tmp_path / "plain.json", tmp_path / "truncating.json"
    tok.save(str(plain))
    tok.enable_truncation(64)
    tok.save(str(truncating))
    tok.no_truncation()
    template = _mistral_template(tmp_path)
    assert json.loads(truncating.read_text())["truncation"]["max_length"] == 64
    assert set(HFTokenizer(str(plain), chat_template=template).reuse._anchors) == {
        (b"[INST]", tok.token_to_id("[INST]")), (b"[/INST]", tok.token_to_id("[/INST]")),
        (b"</s>", tok.token_to_id("</s>"))}  # the template's own, and not the BOS it writes by name
    assert HFTokenizer(str(truncating), chat_template=template).reuse is None
    assert HFTokenizer(str(plain)).reuse is None  # no template: no special tokens known to cut at
