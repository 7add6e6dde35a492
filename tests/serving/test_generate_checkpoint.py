"""examples/generate.py on a checkpoint: its EOS ids, its tokenizer and chat template."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "tests", "data", "checkpoints")
SCRIPT = os.path.join(ROOT, "examples", "generate.py")


def _run(*args, ok=True):
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    if ok:
        assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_checkpoint_token_ids_stop_on_its_eos_ids():
    """Token-id prompts (no tokenizer needed): transformers' greedy tokens, stopping on the
    generation_config.json EOS ids; the dense-cache check passes."""
    with open(os.path.join(DATA, "mistral.expected.json")) as f:
        exp = json.load(f)
    args = ["--checkpoint", os.path.join(DATA, "mistral"), "--no-warmup", "--max-seq-len", "64",
            "--max-new-tokens", "1", str(exp["max_new_tokens"])]
    for p in exp["prompts"]:
        args += ["--prompt-ids", ",".join(map(str, p))]
    out = _run(*args).stdout
    assert f"EOS ids {exp['eos_token_ids']}" in out
    assert "greedy tokens equal the dense-cache implementation: yes" in out
    for i, (p, o) in enumerate(zip(exp["prompts"], exp["outputs"])):
        shown = f"{o[:12]}{' ...' if len(o) > 12 else ''}"
        assert f"[{i}] {len(p)} prompt tokens -> {shown}" in out


def test_bad_checkpoint_exits_with_the_reason(tmp_path):
    proc = _run("--checkpoint", str(tmp_path), ok=False)
    assert proc.returncode != 0
    assert "--checkpoint:" in proc.stderr and "config.json: no such file" in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None
                    or importlib.util.find_spec("jinja2") is None,
                    reason="needs the tokenizers and jinja2 packages")
def test_text_and_chat_prompts():
    from tokenizers import Tokenizer

    ckpt = os.path.join(DATA, "llama3")
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    out = _run("--checkpoint", ckpt, "--prompt", "hello sea", "--no-warmup").stdout
    assert "[0] 'hello sea' -> " in out and "engine: " in out and "1 requests" in out
    assert "prompts 3-3 tokens" in out  # BOS + two words
    chat = _run("--checkpoint", ckpt, "--prompt", "hello sea", "--chat", "--no-warmup").stdout
    # <s><|user|> hello sea <|end|> <|assistant|>: the template's tokens, BOS once.
    want = tok.encode("<s><|user|> hello sea <|end|> <|assistant|>", add_special_tokens=False).ids
    assert len(want) == 6 and f"prompts {len(want)}-{len(want)} tokens" in chat
    assert "greedy tokens equal the dense-cache implementation: yes" in chat


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is not None,
                    reason="checks the message given without the tokenizers package")
def test_text_prompt_without_tokenizers_says_what_is_missing():
    proc = _run("--checkpoint", os.path.join(DATA, "llama3"), "--prompt", "hello", ok=False)
    assert proc.returncode != 0 and "needs the `tokenizers` package" in proc.stderr


def test_chat_without_a_template_is_refused():
    proc = _run("--checkpoint", os.path.join(DATA, "qwen2"), "--prompt-ids", "1,2", "--chat",
                ok=False)
    assert proc.returncode != 0 and "--chat needs --checkpoint DIR with tokenizer.json" in proc.stderr
