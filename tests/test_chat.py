"""Conversation data: every row format renders as the tokenizer's own template does, the assistant mask is exact and
survives packing, the draft-step shift and the loss; bad rows are counted, bad sources refused before any model."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from recycle.chat import MARKERS, SPANS, ChatRenderer, Conversation
from recycle.distill.data import PackedStream, heldout_rows, in_process, mask_steps, regenerate_turns
from recycle.distill.losses import StepOutput, step_terms
from recycle.errors import RecycleError
from recycle.prompts import encode_prompts, read_jsonl
from recycle.texts import data_source

from tests.cli_helpers import assert_bad_input, run_cli

ROOT = Path(__file__).resolve().parents[1]
CHAT = ROOT / "fixtures" / "deepseek_v3_mtp_chat"

CONVS = [
    [{"role": "system", "content": "Answer with code."}, {"role": "user", "content": "Write add(a, b)."},
     {"role": "assistant", "content": "def add(a, b):\n    return a + b"}],
    [{"role": "user", "content": "Write neg(x)."}, {"role": "assistant", "content": "def neg(x):\n    return -x"},
     {"role": "user", "content": "Rename x to value."},
     {"role": "assistant", "content": "def neg(value):\n    return -value"}],
    [{"role": "user", "content": "Think first."}, {"role": "assistant", "content": "<think>\n\n</think>\n\nok = 1"}],
    [{"role": "user", "content": "Call the tool."}, {"role": "tool", "content": "42"},
     {"role": "assistant", "content": "x = 42"}],
]


def sharegpt(msgs: list[dict]) -> dict:
    names = {"user": "human", "assistant": "gpt", "system": "system", "tool": "tool"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in msgs]}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(CHAT)
    t.model_max_length = 1 << 62
    return t


def reference(tok, msgs: list[dict]) -> tuple[list[int], list[bool]]:
    out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def test_every_row_format_renders_as_the_tokenizer_does(tok, tmp_path):
    from datasets import Dataset

    (tmp_path / "m.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVS))
    (tmp_path / "s.json").write_text(json.dumps([sharegpt(c) for c in CONVS]))
    Dataset.from_list([{"messages": c} for c in CONVS]).save_to_disk(str(tmp_path / "dm"))
    Dataset.from_list([sharegpt(c) for c in CONVS]).save_to_disk(str(tmp_path / "ds"))
    renderer = ChatRenderer(tok)
    assert renderer.method == MARKERS
    for name in ("m.jsonl", "s.json", "dm", "ds"):
        src = data_source(tmp_path / name)
        docs = src.train() + src.heldout()
        assert len(docs) == len(CONVS) and all(isinstance(d, Conversation) for d in docs), name
        for d, msgs in zip(docs, CONVS):
            r = renderer.render(d)
            ids, mask = reference(tok, msgs)
            assert r.ids == ids, name
            think = "<think>" in msgs[-1]["content"]
            assert r.mask == mask or think, name
        kind = "sharegpt" if name in ("s.json", "ds") else "messages"
        assert src.log.rows == {kind: len(CONVS)}


def test_a_cached_dataset_by_name_loads_offline(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVS))
    datasets.load_dataset("json", data_files={"train": str(tmp_path / "rows.jsonl")})
    built = next((tmp_path / "cache" / "json").glob("default-*/0.0.0/*/"))
    named = tmp_path / "cache" / "acme___chats" / "default" / "0.0.0" / built.name
    named.mkdir(parents=True)
    for f in built.iterdir():  # what a download of "acme/chats" leaves in the cache
        shutil.copy(f, named / f.name.replace("json-", "chats-"))
    src = data_source("hf:acme/chats")
    assert len(src.train() + src.heldout()) == len(CONVS) and src.log.rows == {"messages": len(CONVS)}
    with pytest.raises(RecycleError, match="not in the local datasets cache"):
        data_source("hf:acme/absent").train()


def test_generation_markers_and_span_matching_agree(tok):
    from transformers import AutoTokenizer

    marked = ChatRenderer(tok)
    plain = AutoTokenizer.from_pretrained(CHAT)  # the same template without its generation markers
    spans = ChatRenderer(plain, template=plain.chat_template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""))
    assert (marked.method, spans.method) == (MARKERS, SPANS)
    for msgs in CONVS:
        a = marked.render(Conversation(tuple(msgs)))
        b = spans.render(Conversation(tuple(msgs)))
        assert a.ids == b.ids and a.mask == b.mask
        text = tok.decode([i for i, m in zip(a.ids, a.mask) if m])
        # exactly the assistant turns' contents, each with its end-of-turn token; an empty think block is not there
        want = "".join(m["content"].replace("<think>\n\n</think>\n\n", "") + "<|end|>"
                       for m in msgs if m["role"] == "assistant")
        assert text == want


@pytest.fixture(autouse=True)
def _fixture_template(tok):
    """Tests may swap the template on the shared tokenizer: each starts from the fixture's own."""
    import json as _json

    tok.chat_template = _json.loads((CHAT / "tokenizer_config.json").read_text())["chat_template"]


def test_packing_carries_the_mask_and_only_masked_positions_count(tok, tmp_path):
    rows = [{"messages": c} for c in CONVS] * 6 + [{"text": "plain text, every token counts " * 4}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = data_source(tmp_path / "d.jsonl")
    renderer = ChatRenderer(tok)
    stream = PackedStream(src.train, tok, 16, seed=1, renderer=renderer, log=src.log)
    ids, mask = stream.take_masked(12)
    assert ids.shape == mask.shape == (12, 16)
    # the windows are the shuffled documents' rendered ids and masks, concatenated with EOS (masked out)
    flat_ids, flat_mask = [], []
    order = list(range(len(src.train())))
    random.Random("1:0").shuffle(order)  # epoch 0 of seed 1
    for d in [src.train()[i] for i in order]:
        if isinstance(d, Conversation):
            r = renderer.render(d)
            flat_ids += r.ids + [tok.eos_token_id]
            flat_mask += r.mask + [False]
        else:
            enc = tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            flat_ids += enc
            flat_mask += [True] * len(enc)
    assert ids.flatten().tolist() == flat_ids[:12 * 16] and mask.flatten().tolist() == flat_mask[:12 * 16]
    # the draft-step shift: step k at anchor i counts iff token i+k+2 is an assistant token
    b, length, k_steps, vocab = 12, 16, 3, 11
    t = length - k_steps - 1
    steps = [StepOutput(torch.randn(b * t, vocab), torch.randn(b * t, vocab), torch.zeros(b * t, dtype=torch.long))
             for _ in range(k_steps)]
    mask_steps(steps, mask)
    for k, s in enumerate(steps):
        assert s.mask.view(b, t).tolist() == mask[:, k + 2:k + 2 + t].tolist()
        before = step_terms(s, grad=False)
        s.draft[~s.mask] = torch.randn(int((~s.mask).sum()), vocab) * 50  # masked-out rows: anything at all
        after = step_terms(s, grad=False)
        assert torch.allclose(before["kl"], after["kl"]) and torch.allclose(before["agree"], after["agree"])


def test_heldout_rows_carry_their_mask(tok, tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVS * 10))
    ids, mask = heldout_rows(tok, 32, 4, str(tmp_path / "d.jsonl"), ChatRenderer(tok))
    assert mask is not None and mask.shape == ids.shape and 0 < int(mask.sum()) < mask.numel()
    with pytest.raises(RecycleError, match="chat renderer"):
        heldout_rows(tok, 32, 4, str(tmp_path / "d.jsonl"))


def test_a_mixed_file_records_what_it_skipped(tmp_path):
    lines = [json.dumps({"messages": CONVS[0]}), json.dumps(sharegpt(CONVS[1])), json.dumps({"text": "some text"}),
             "{not json", json.dumps({"messages": [{"role": "user", "content": "no answer"}]}),
             json.dumps({"messages": [{"role": "wizard", "content": "?"}, {"role": "assistant", "content": "!"}]}),
             json.dumps({"conversations": [{"from": "alien", "value": "?"}]}), json.dumps({"prompt": "neither"}),
             json.dumps([1, 2])]
    (tmp_path / "mix.jsonl").write_text("\n".join(lines) + "\n")
    src = data_source(tmp_path / "mix.jsonl")
    src.train()
    assert src.log.to_json() == {"documents": 3, "rows": {"messages": 1, "sharegpt": 1, "text": 1}, "skipped": {
        "not valid JSON": 1, "no assistant turn": 1, "unknown role 'wizard'": 1, "unknown role 'alien'": 1,
        "neither text nor a conversation (no 'text', 'messages' or 'conversations' field)": 1,
        "not a JSON object": 1}}


def test_self_distill_keeps_the_other_turns_byte_for_byte(tok):
    from transformers import AutoModelForCausalLM

    from recycle.encode import quiet_transformers

    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(CHAT, dtype=torch.float32).eval()
    docs = [Conversation(tuple(c)) for c in CONVS[:2]] + ["plain text stays"]
    out = regenerate_turns(in_process(model, tok.pad_token_id), ChatRenderer(tok), docs, 0.0, 0, max_new_tokens=6)
    assert out[2] == "plain text stays"
    for new, old in zip(out[:2], docs[:2]):
        assert [m["role"] for m in new.messages] == [m["role"] for m in old.messages]
        for a, b in zip(new.messages, old.messages):
            if b["role"] != "assistant":
                assert a == b
    # greedy: the first assistant turn is what the target writes after the rendered generation prompt
    renderer = ChatRenderer(tok)
    prompt = tok(renderer.prompt(CONVS[0][:2]), add_special_tokens=False, return_tensors="pt")["input_ids"]
    gen = model.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=renderer.stop_ids())[0, prompt.shape[1]:]
    gen = [t for t in gen.tolist()]
    stop = next((j for j, t in enumerate(gen) if t in renderer.stop_ids()), len(gen))
    assert out[0].messages[2]["content"] == tok.decode(gen[:stop])


def test_chat_prompts_render_through_the_generation_prompt(tok, tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"messages": CONVS[1], "set": "chat"}) + "\n"
                                      + json.dumps({"prompt": "def f(", "set": "code"}) + "\n")
    prompts = read_jsonl(tmp_path / "p.jsonl")
    assert [s for s, _ in prompts] == ["chat", "code"]
    ids = encode_prompts(tok, prompts, "fixture")
    want = tok.apply_chat_template(CONVS[1][:3], tokenize=True, add_generation_prompt=True, return_dict=True)
    assert ids[0] == list(want["input_ids"]) and ids[1] == tok("def f(", add_special_tokens=False)["input_ids"]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
    with pytest.raises(RecycleError, match="opens with the assistant"):
        read_jsonl(tmp_path / "bad.jsonl")


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    out = tmp_path_factory.mktemp("chat") / "eagle"
    res = run_cli("convert", str(CHAT), "--to", "eagle", "-o", str(out))
    assert res.exit_code == 0, res.output
    return out


def test_bad_chat_input_is_refused_before_any_model_loads(tmp_path, drafter):
    from transformers import AutoTokenizer

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVS * 4))
    # a target whose tokenizer has no template: the chat fixture without its template
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in CHAT.iterdir():
        if f.suffix == ".safetensors":
            shutil.copy(f, bare / f.name)  # a shard must live in its checkpoint, not link out of it
        else:
            (bare / f.name).symlink_to(f)
    cfg = json.loads((CHAT / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (bare / "tokenizer_config.json").unlink()
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    res = run_cli("distill", str(drafter), "--target", str(bare), "--tokens", "4k", "--data", str(data),
                  "-o", str(tmp_path / "o"))
    assert_bad_input(res, "--chat-template FILE")
    # a template that fails on every row
    bad = tmp_path / "raise.jinja"
    bad.write_text("{{ raise_exception('no') }}")
    tok = AutoTokenizer.from_pretrained(CHAT)
    with pytest.raises(RecycleError, match=r"none of the first \d+ conversations renders .*failed to render \(no\)"):
        from recycle.encode import chat_renderer

        chat_renderer(data_source(data).train(), tok, "t", bad)
    res = run_cli("distill", str(drafter), "--target", str(CHAT), "--tokens", "4k", "--data", str(data),
                  "--chat-template", str(bad), "-o", str(tmp_path / "o"))
    assert_bad_input(res, "renders with")
    # nothing usable at all
    junk = tmp_path / "junk.jsonl"
    junk.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    res = run_cli("distill", str(drafter), "--target", str(CHAT), "--tokens", "4k", "--data", str(junk),
                  "-o", str(tmp_path / "o"))
    assert_bad_input(res, "1 no assistant turn")
    assert not (tmp_path / "o").exists()


def test_distill_on_conversations_counts_assistant_tokens_and_keeps_what_it_regenerated(tmp_path, drafter):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVS * 8)
                    + json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
    saved = tmp_path / "regenerated.jsonl"
    res = run_cli("distill", str(drafter), "--target", str(CHAT), "--tokens", "256", "--data", str(data),
                  "--batch", "2", "--seq-len", "64", "--eval-every", "1", "--self-distill", "--save-regenerated",
                  str(saved), "-o", str(tmp_path / "out"), "--json")
    assert res.exit_code == 0, res.output
    record = json.loads((tmp_path / "out" / "recycle.json").read_text())["distillation"][-1]
    assert record["data"]["rows"] == {"messages": len(CONVS) * 8} and record["data"]["skipped"] == {
        "no assistant turn": 1}
    assert record["data"]["chat"]["mask"] == MARKERS and record["heldout"]["counted"] == "assistant tokens"
    kept = [json.loads(line)["messages"] for line in saved.read_text().splitlines()]
    assert kept
    originals = {json.dumps([m for m in c if m["role"] != "assistant"]) for c in CONVS}
    for msgs in kept:  # the user, system and tool turns are the data's, byte for byte
        assert json.dumps([m for m in msgs if m["role"] != "assistant"]) in originals


def test_the_chat_fixture_keeps_the_base_mtp_bytes_and_reserves_its_specials_inside_the_vocabulary(tok):
    from recycle.checkpoint import Checkpoint
    from recycle.families import match

    base, chat = Checkpoint(ROOT / "fixtures" / "deepseek_v3_mtp"), Checkpoint(CHAT)
    names = match(base).mtp_names
    assert set(names) == set(match(chat).mtp_names)
    assert all(torch.equal(base.raw(n), chat.raw(n)) for n in names)  # stale by construction
    assert not torch.equal(base.raw("lm_head.weight"), chat.raw("lm_head.weight"))
    assert len(tok) == chat.config["vocab_size"] == 4096  # the specials took ids inside the vocabulary
    specials = tok.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"])
    assert all(0 <= i < 4096 for i in specials) and len(set(specials)) == 5
    assert ChatRenderer(tok).stop_ids() == [tok.convert_tokens_to_ids("<|end|>"), tok.eos_token_id]
    report = json.loads((CHAT / "build_report.json").read_text())
    assert report["after"]["assistant_loss"] < report["before"]["assistant_loss"] - 0.5
    assert report["after"]["mtp_top1_vs_trunk"][0] < report["before"]["mtp_top1_vs_trunk"][0] - 0.05
    rows = [json.loads(line) for line in (CHAT / "chat_heldout.jsonl").read_text().splitlines()]
    assert len(rows) == report["conversations"]["heldout"] and all("messages" in r for r in rows)


def test_harvest_regenerates_conversations_once_through_its_generator_and_stores_the_mask(tok, tmp_path):
    """`harvest --self-distill` on conversations: every window the budget reads is packed from conversations whose
    assistant turns the generator wrote (here a stand-in for vLLM that answers with fixed tokens), user turns kept,
    each conversation regenerated once, in blocks; the windows carry their assistant mask."""
    from recycle.distill.harvest import eval_rows, plan
    from recycle.options import HarvestOptions

    answer = tok("pass", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|end|>")]
    calls: list[int] = []

    def generate(prompts, max_new, temperature, seed, stops):
        calls.append(len(prompts))
        assert stops[0] == answer[-1] and max_new == 64
        return [list(answer) for _ in prompts]

    rows = [{"messages": c} for c in CONVS] * 12
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    opts = HarvestOptions(target=str(CHAT), out=str(tmp_path / "cache"), tokens=1024, data=str(tmp_path / "d.jsonl"),
                          seq_len=64, batch=4, self_distill=True)
    windows, regen = plan(opts, tok, generate)
    assert sum(int(ids.numel()) for _, ids, _ in windows) == 1024 and all(m is not None for _, _, m in windows)
    assert regen is not None and len(calls) == 2 * regen.runs  # two assistant rounds per engine run, not per chunk
    for i, conv in regen.done.items():
        original = regen.stream.texts()[i]
        assert [m for m in conv.messages if m["role"] != "assistant"] == [
            m for m in original.messages if m["role"] != "assistant"]
        assert all(m["content"] == "pass" for m in conv.messages if m["role"] == "assistant")
    ids, mask = windows[0][1], windows[0][2]
    # the masked tokens of the windows are the regenerated answers: "pass<|end|>" and nothing else
    assert set(tok.decode([t for t, m in zip(ids.flatten().tolist(), mask.flatten().tolist()) if m]).split("<|end|>")) \
        <= {"pass", ""}
    ev, prompt, ev_mask = eval_rows(opts, tok, generate)
    assert prompt == 0 and ev_mask is not None and ev_mask.shape == ev.shape


# -- chat requests as prompts, empty answers, broken lines, long documents, runaway templates (issue 45) ------------

REQUESTS = [
    [{"role": "user", "content": "Write add(a, b)."}],
    [{"role": "system", "content": "Answer with code."}, {"role": "user", "content": "Write neg(x)."}],
    [{"role": "user", "content": "Write neg(x)."}, {"role": "assistant", "content": "def neg(x):\n    return -x"},
     {"role": "user", "content": "Rename x to value."}],  # a multi-turn request: its last turn is the user's
]


def test_chat_requests_without_an_answer_render_through_the_generation_prompt(tok, tmp_path, drafter):
    rows = [{"messages": m, "set": "chat"} for m in REQUESTS] + [sharegpt(REQUESTS[1])] + [{"messages": CONVS[0]}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = read_jsonl(tmp_path / "p.jsonl")
    ids = encode_prompts(tok, prompts, "fixture")
    # an engine's chat endpoint: the request's turns, then the assistant's generation prompt (the tokenizer's own)
    for got, msgs in zip(ids, REQUESTS + [REQUESTS[1], CONVS[0][:2]]):
        want = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=True)
        assert got == list(want["input_ids"])
    assert ids[0][-1] == tok.convert_tokens_to_ids("<|assistant|>")  # ends in the generation prompt
    # through the CLI: a request runs, its prompt the generation prompt's tokens
    (tmp_path / "one.jsonl").write_text(json.dumps({"messages": REQUESTS[1]}) + "\n")
    res = run_cli("bench", str(drafter), "--target", str(CHAT), "--prompts", str(tmp_path / "one.jsonl"),
                  "--max-new-tokens", "4", "--tree", "chain:1", "--json")
    assert res.exit_code == 0, res.output
    assert [r["prompt_tokens"] for r in json.loads(res.stdout)["prompts"]] == [len(ids[1])]


def test_distill_on_empty_answers_is_refused_with_the_counts_before_any_model_loads(tmp_path, drafter, monkeypatch):
    import recycle.distill.setup as setup

    def never(*a, **k):
        raise AssertionError("a model loaded before the data was checked")

    monkeypatch.setattr(setup, "load_drafter", never)
    monkeypatch.setattr(setup, "Teacher", never)
    empty = [[{"role": "user", "content": "Write add(a, b)."}, {"role": "assistant", "content": ""}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
              {"role": "assistant", "content": "<think></think>"}, {"role": "user", "content": "And?"},
              {"role": "assistant", "content": "  \n"}]]
    data = tmp_path / "empty.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in empty * 3)
                    + json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
    res = run_cli("distill", str(drafter), "--target", str(CHAT), "--tokens", "4k", "--seq-len", "128",
                  "--data", str(data), "-o", str(tmp_path / "o"))
    assert_bad_input(res, "7 conversations read, all skipped (6 only empty assistant turns, 1 no assistant turn)")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.distill").exists()
    # one answered conversation among them is enough to read (an empty turn beside a real one is no skip)
    src = data_source(_write(tmp_path / "some.jsonl", [{"messages": c} for c in empty + [CONVS[1]]]
                             + [{"messages": CONVS[0][:2] + [{"role": "assistant", "content": ""}] + CONVS[1][1:]}]))
    assert len(src.train() + src.heldout()) == 2 and src.log.skipped == {"only empty assistant turns": 2}


def _write(path: Path, rows: list, broken: dict[int, str] | None = None) -> Path:
    lines = [json.dumps(r) for r in rows]
    for at, text in sorted((broken or {}).items()):
        lines.insert(at - 1, text)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_broken_jsonl_line_is_named_once_and_counted(tmp_path, capsys):
    rows = [{"text": f"document {i} " * 20} for i in range(6)]
    src = data_source(_write(tmp_path / "d.jsonl", rows, {3: '{"text": "cut off', 7: "{"}))
    src.heldout()
    assert src.log.documents == 6
    data_source(tmp_path / "d.jsonl").heldout()  # read again (the held-out side): said once
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == [f"recycle: warning: --data {tmp_path / 'd.jsonl'}: skipped 2 of 8 rows (6 text, 2 other): "
                   "2 not valid JSON (line 3, line 7)"]
    assert src.log.to_json()["skipped"] == {"not valid JSON": 2}
    # a source with nothing usable is refused in one line, with the lines named
    with pytest.raises(RecycleError, match=r"2 other rows read, all skipped \(1 not a JSON object, 1 not valid JSON "
                                           r"\(line 2\); rows need"):
        data_source(_write(tmp_path / "b.jsonl", [[1]], {2: "{oops"})).train()


def test_counts_are_singular_or_plural():
    from recycle.texts import plural

    assert [plural(1, "document"), plural(2, "document"), plural(1_000, "row"), plural(0, "entry", "entries")] == [
        "1 document", "2 documents", "1,000 rows", "0 entries"]
    src = ROOT / "distill" / "setup.py"  # the data's passes note, written at set-up
    assert "documents)" not in src.read_text()  # the one count that printed "(1 documents)"


def test_a_long_single_line_file_is_read_in_pieces_that_tokenize_as_the_stream(tok, tmp_path, monkeypatch):
    import pathlib

    import recycle.texts as texts

    limit = 64 << 10
    monkeypatch.setattr(texts, "DOC_CHARS", limit)
    words = random.Random(0).choices(["def", "return", "value", "x", "(a, b)", "+", "1", "pass:"], k=600_000)
    text = " ".join(words)  # ≈ 2.6 MB, one line
    assert "\n" not in text and len(text) > 2_000_000
    (tmp_path / "one.txt").write_text(text)

    def whole(self, *a, **k):
        raise AssertionError(f"{self} was read whole")

    monkeypatch.setattr(pathlib.Path, "read_text", whole)
    src = data_source(tmp_path / "one.txt")
    train, held = src.train(), src.heldout()
    pieces = train + held
    assert "".join(pieces) == text and len(pieces) >= len(text) // limit
    assert all(len(p) <= limit for p in pieces) and all(p.startswith(" ") for p in pieces[1:len(train)])
    assert src.log.rows == {"text": 1} and src.log.documents >= len(text) // limit
    # the training stream is the pieces tokenized one by one, each followed by EOS, in the epoch's order
    stream = PackedStream(src.train, tok, 256, seed=3)
    got = stream.take(24).flatten().tolist()
    order = list(range(len(train)))
    random.Random("3:0").shuffle(order)
    want: list[int] = []
    for i in order:
        want += tok(train[i], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        if len(want) >= len(got):
            break
    assert got == want[:len(got)]
    # a huge text row in JSONL is cut the same way
    monkeypatch.undo()
    monkeypatch.setattr(texts, "DOC_CHARS", limit)
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": text}) + "\n")
    rows = data_source(tmp_path / "one.jsonl")
    assert rows.train() + rows.heldout() == pieces


def _looping_target(tmp_path: Path) -> Path:
    """The chat fixture with a chat template that loops 10^10 times (the sandbox allows range(100000), twice)."""
    target = tmp_path / "looping"
    target.mkdir()
    for f in CHAT.iterdir():
        if f.suffix == ".safetensors":
            shutil.copy(f, target / f.name)  # a shard must live in its checkpoint, not link out of it
        elif f.name != "tokenizer_config.json":
            (target / f.name).symlink_to(f)
    cfg = json.loads((CHAT / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                            + cfg["chat_template"])
    (target / "tokenizer_config.json").write_text(json.dumps(cfg))
    return target


def test_a_chat_template_that_runs_forever_is_refused_in_one_line(tmp_path, drafter, monkeypatch):
    import time

    import recycle.chat as chat

    monkeypatch.setattr(chat, "TEMPLATE_SECONDS", 0.5)
    target = _looping_target(tmp_path)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVS * 4))
    t0 = time.perf_counter()
    res = run_cli("distill", str(drafter), "--target", str(target), "--tokens", "4k", "--data", str(data),
                  "-o", str(tmp_path / "o"))
    assert_bad_input(res, f"{target}'s chat template ran over 0.5 s rendering one conversation")
    assert not (tmp_path / "o").exists()
    (tmp_path / "p.jsonl").write_text(json.dumps({"messages": REQUESTS[0]}) + "\n")
    res = run_cli("bench", str(drafter), "--target", str(target), "--prompts", str(tmp_path / "p.jsonl"))
    assert_bad_input(res, "ran over 0.5 s")
    loop = tmp_path / "loop.jinja"
    loop.write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    res = run_cli("bench", str(drafter), "--target", str(CHAT), "--prompts", str(tmp_path / "p.jsonl"),
                  "--chat-template", str(loop))
    assert_bad_input(res, "the --chat-template ran over 0.5 s")
    assert time.perf_counter() - t0 < 30
    # renders that finish in time leave nothing behind: no late exception reaches the thread afterwards
    from transformers import AutoTokenizer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(CHAT))
    monkeypatch.setattr(chat, "TEMPLATE_SECONDS", 0.05)
    for _ in range(50):
        renderer.render(Conversation(tuple(CONVS[1])))
    time.sleep(0.2)
    assert sum(range(10_000)) == 49_995_000
