"""The chat questions a target asks itself (`mlxspec.train.asked`, `--regen-questions`), on the
real SmolLM2-135M-Instruct and its chat template."""

from __future__ import annotations

import json

import pytest

from mlxspec.errors import MlxspecError
from mlxspec.prompts import CHAT_QUESTIONS
from mlxspec.train.asked import clean, sample_questions, stored_questions, user_prefix


def test_the_user_prefix_is_the_template_up_to_the_users_words(smollm2):
    _, tok = smollm2
    text = tok.decode(user_prefix(tok))
    assert text.endswith("<|im_start|>user\n") and text.startswith("<|im_start|>system\n")


def test_the_target_asks_distinct_questions_the_same_for_a_seed(smollm2):
    """Every question is one finished user turn (cleaned), none repeats, none is a held-out
    chat prompt, and a seed gives the same questions again."""
    target, tok = smollm2
    qs = sample_questions(target, tok, 6, seed=3, max_tokens=48, batch=8)
    assert len(qs) == len(set(qs)) == 6
    assert not set(qs) & set(CHAT_QUESTIONS)
    assert all(clean(q) == q for q in qs)
    assert sum(q.rstrip().endswith(("?", ".", "!")) for q in qs) >= 4  # questions and requests, not fragments
    assert sample_questions(target, tok, 3, seed=3, max_tokens=48, batch=8) == qs[:3]
    assert sample_questions(target, tok, 3, seed=4, max_tokens=48, batch=8) != qs[:3]


@pytest.mark.parametrize("text,want", [("  Can you   explain\nrecursion?  ", "Can you explain recursion?"),
                                       ("short?", None), ("Résumé tips for a café job, please?", None),
                                       ("See https://example.com for what I mean, please", None),
                                       ("What is <|im_start|> used for in chat?", None), ("1234 5678 9012 3456 ??", None)])
def test_clean_keeps_what_a_user_would_send(text, want):
    assert clean(text) == want


def test_a_store_keeps_its_questions_and_refuses_others(smollm2, tmp_path):
    """stored_questions reads the store's questions.json when it is there (a resumed store asks
    the same questions), and refuses one written for another seed."""
    target, tok = smollm2
    (tmp_path / "questions.json").write_text(json.dumps({"format": "mlxspec-asked-1", "seed": 5,
                                                          "questions": ["What is a tide?", "Why is the sky blue?"]}))
    assert stored_questions(target, tok, tmp_path, 2, 5) == ["What is a tide?", "Why is the sky blue?"]
    with pytest.raises(MlxspecError, match="holds questions for other settings; pass a new --data directory"):
        stored_questions(target, tok, tmp_path, 2, 6)
    with pytest.raises(MlxspecError, match="holds questions for other settings"):
        stored_questions(target, tok, tmp_path, 3, 5)  # asks for more than it holds
    for bad, msg in [('{"format": "mlxspec-as', "unreadable \\(JSONDecodeError\\); delete it"),
                     (b"\xff\xfe", "unreadable \\(UnicodeDecodeError\\)"),
                     ('["What is a tide?"]', "is not a question list"),
                     ('{"format": "mlxspec-asked-1", "seed": 5, "questions": ["What is a tide?", 7]}',
                      "is not a question list")]:
        f = tmp_path / "questions.json"
        f.write_bytes(bad) if isinstance(bad, bytes) else f.write_text(bad)
        with pytest.raises(MlxspecError, match=msg):
            stored_questions(target, tok, tmp_path, 1, 5)


def test_self_and_mixed_question_pools(smollm2):
    """self: the chat kinds answer only the target's own questions; mixed: the target's and the
    corpus's in turn; the continuation pools are the corpus mode's either way."""
    from mlxspec.train.regen import chat_questions, plan_items

    _, tok = smollm2
    asked = [f"Question number {i}: what is a good name for a cat?" for i in range(40)]
    corpus = plan_items(tok, 64)
    self_ = plan_items(tok, 64, asked=asked, questions="self")
    mixed = plan_items(tok, 64, asked=asked, questions="mixed")
    for k in ("cont-t0", "cont-t0.7"):
        assert [list(i) for _, i in self_[k]] == [list(i) for _, i in corpus[k]] == [list(i) for _, i in mixed[k]]
    dealt = [x for pair in zip(self_["chat-t0"], self_["chat-t0.7"]) for x in pair]
    assert [tok.decode(list(i)).count("Question number") for _, i in dealt] == [1] * len(dealt)
    assert [c for c, _ in dealt] == ["chat-self"] * len(dealt)
    m = [x for pair in zip(mixed["chat-t0"], mixed["chat-t0.7"]) for x in pair]
    assert [c for c, _ in m[:4]] == ["chat-self", chat_questions(0)[0][0], "chat-self", chat_questions(0)[1][0]]


def test_regen_questions_outside_regen_mode_or_without_a_template_is_one_line(tmp_path, capsys):
    import conftest

    from mlxspec.cli import main

    rc = main(["train", "--out", str(tmp_path / "o"), "--data-mode", "corpus", "--regen-questions", "self",
               "--prepare-only"])
    err = capsys.readouterr().err
    assert rc == 2 and "--regen-questions applies to --data-mode regen" in err and len(err.strip().splitlines()) == 1
    model = tmp_path / "tiny.gguf"
    conftest.write_tiny_model(model)
    d = tmp_path / "d"
    rc = main(["train", "--model", str(model), "--prepare-only", "--data-mode", "regen", "--regen-questions", "self",
               "--data", str(d), "--out", str(tmp_path / "o2")])
    err = capsys.readouterr().err
    assert rc == 2 and "--regen-questions self needs a target with a chat template" in err, err
    assert len(err.strip().splitlines()) == 1 and not (d / "meta.json").exists()
    rc = main(["train", "--model", str(model), "--prepare-only", "--data-mode", "regen", "--regen-questions", "mixed",
               "--data", str(d), "--out", str(tmp_path / "o3")])
    err = capsys.readouterr().err
    assert rc == 2 and "--regen-questions mixed needs a target with a chat template" in err, err


def test_a_self_question_store_answers_the_questions_it_keeps(smollm2, tmp_path):
    """prepare_regen_store with questions="self": questions.json is written first, every chat
    window's prompt is one of its questions in the target's chat template, the store records
    the setting, and a resume with corpus questions is refused."""
    import numpy as np

    from mlxspec.prompts import encode_prompt
    from mlxspec.train.regen import prepare_regen_store

    target, tok = smollm2
    d = tmp_path / "s"
    prepare_regen_store(target, tok, d, [1, 8, 15], seq_len=96, windows=4, batch=1, seed=2, questions="self")
    qs = json.loads((d / "questions.json").read_text())["questions"]
    assert json.loads((d / "meta.json").read_text())["questions"] == "self"
    src, start, tokens = (np.load(d / f"{k}.npy") for k in ("source", "start", "tokens"))
    prompts = {tuple(encode_prompt(tok, "chat", q)) for q in qs}
    chat = [i for i in range(4) if src[i].startswith("chat-")]
    assert len(chat) == 2 and all(tuple(tokens[i, : start[i]]) in prompts for i in chat)
    with pytest.raises(MlxspecError, match="prepared with other settings \\(questions\\)"):
        prepare_regen_store(target, tok, d, [1, 8, 15], seq_len=96, windows=4, batch=1, seed=2)
