#!/usr/bin/env python
"""Writes the tiny checkpoints and the expected outputs the checkpoint tests compare with.

Runs where ``transformers``, ``torch``, ``safetensors``, ``numpy`` and ``tokenizers`` are
installed (not jax_paged's environment)::

    python dev/make_checkpoint_fixtures.py            # writes tests/data/checkpoints/

For each family it builds a small random-weight model with transformers, saves it with
``save_pretrained`` (safetensors, in the storage dtype listed below; the Llama 3 one in shards
with an index), reloads it in float32 with eager attention and records

- ``<name>/`` the checkpoint as saved (config.json, generation_config.json, weights);
- ``<name>.logits.npy`` float32 ``[T, vocab]``: logits of ``LOGITS_PROMPT`` (longer than every
  sliding window);
- ``<name>.expected.json``: the prompts, the EOS ids, the greedy tokens of
  ``model.generate`` for each prompt (EOS included when hit), and the smallest top-1 / top-2
  logit margin seen (the tests' token comparisons are only meaningful when it is far above
  float32 rounding; the script refuses margins under ``MIN_MARGIN``).

Weights are drawn at unit scale (linear ~ N(0, 1/fan_in), untied embeddings ~ N(0, 1)), not
transformers' 0.02 initialiser, so logits are spread out and greedy tokens are not near-ties.
One EOS id of each family is a token the model emits mid-way through one prompt's output, so
every family's expected tokens include a stop on EOS.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "checkpoints")
VOCAB = 128
LOGITS_PROMPT = [int(t) for t in np.random.default_rng(1234).integers(3, VOCAB, 20)]
PROMPT_LENS = [3, 11, 19, 6]
MAX_NEW_TOKENS = 12
MIN_MARGIN = 1e-3

COMMON = dict(vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)

FAMILIES = {
    # Llama 3.2 style: tied embeddings, llama3 RoPE scaling (original context 32, so the
    # fixture's positions sit in every band of the scaling), sharded with an index.
    "llama3": dict(
        cls=transformers.LlamaConfig, storage=torch.float32, shard="120KB", seed=11,
        config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    rms_norm_eps=1e-5, tie_word_embeddings=True,
                    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                         low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=32))),
    # Mistral: every layer windowed (8 tokens); fp16 weights.
    "mistral": dict(
        cls=transformers.MistralConfig, storage=torch.float16, shard=None, seed=12,
        config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    rms_norm_eps=1e-5, sliding_window=8, tie_word_embeddings=False,
                    rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    # Qwen2: q/k/v biases; bf16 weights.
    "qwen2": dict(
        cls=transformers.Qwen2Config, storage=torch.bfloat16, shard=None, seed=13,
        config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, use_sliding_window=False,
                    rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    # Qwen3: per-head q/k RMSNorm, head_dim (16) other than hidden / heads (12), tied.
    "qwen3": dict(
        cls=transformers.Qwen3Config, storage=torch.float32, shard=None, seed=14,
        config=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                    rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    # Gemma 2: head size 256, local (window 6) / global layers, both soft caps small enough to
    # bite, query_pre_attn_scalar other than head_dim; bf16 weights.
    "gemma2": dict(
        cls=transformers.Gemma2Config, storage=torch.bfloat16, shard=None, seed=15,
        config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                    query_pre_attn_scalar=64, sliding_window=6, attn_logit_softcapping=3.0,
                    final_logit_softcapping=8.0, rms_norm_eps=1e-6,
                    rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
}


def init_unit_scale(model: torch.nn.Module, family: str, seed: int) -> None:
    """Redraws every parameter at unit scale (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                # Gemma's norms scale by (1 + w): draw w near 0 there, near 1 elsewhere.
                p.copy_(0.1 * z if family == "gemma2" else 1.0 + 0.1 * z)
            elif name.endswith(".bias"):
                p.copy_(0.5 * z)
            elif "embed_tokens" in name:
                # Tied models read logits off the embedding: a small one keeps the residual
                # stream from being the input token's own row (which repeats it forever).
                tied = model.config.tie_word_embeddings
                scale = 1.0 if not tied else 0.25 / (
                    math.sqrt(model.config.hidden_size) if family == "gemma2" else 1.0)
                p.copy_(scale * z)
            else:
                p.copy_(z / math.sqrt(p.shape[-1]))


def margin(scores: torch.Tensor) -> float:
    top = torch.topk(scores.float(), 2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


def greedy(model, prompts, eos_ids):
    """model.generate per prompt (no padding); (outputs, smallest top-2 margin)."""
    outs, smallest = [], math.inf
    for p in prompts:
        gc = GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=0,
                              eos_token_id=list(eos_ids) or None, pad_token_id=0)
        r = model.generate(torch.tensor([p]), generation_config=gc, output_scores=True,
                           return_dict_in_generate=True)
        outs.append([int(t) for t in r.sequences[0, len(p):]])
        smallest = min(smallest, min(margin(s) for s in r.scores))
    return outs, smallest


def write_tokenizer(directory: str) -> None:
    """A word-level tokenizer over VOCAB ids with special tokens and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ("hello capital france paris sea poem "
             "the a of to and in is was for on that with as it by at be this from or are an "
             "which one you had not but all were we when there can more if no out so said what "
             "up its about into than them only other new some could time these two may then do "
             "first any my now such like our over man me even most made after also did many "
             "before must through back years where much your way well down should because each "
             "just those people how too little state good very make world still own see men work "
             "long get here between both life being under never day same another know while last "
             "might us great old year off come since against go came right used take three").split()
    special = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>", "<unk>", "."]
    vocab = {t: i for i, t in enumerate(special)}
    for w in words:
        if len(vocab) < VOCAB and w not in vocab:
            vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Punctuation()])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    from tokenizers import decoders
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    for s in special[:7]:
        tok.add_special_tokens([s])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> "
                          "{{ m['content'] }} <|end|> {% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    fast.save_pretrained(directory)


def make(name: str, spec: dict) -> dict:
    torch.manual_seed(spec["seed"])
    cfg = spec["cls"](**COMMON, **spec["config"])
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    init_unit_scale(model, name, spec["seed"])
    model = model.to(spec["storage"]).eval()
    rng = np.random.default_rng(spec["seed"])
    prompts = [[int(t) for t in rng.integers(3, VOCAB, n)] for n in PROMPT_LENS]

    # The EOS ids: one the model never emits for these prompts and one it emits mid-way.
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(torch.float32)
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    ref.eval()
    free_run, _ = greedy(ref, prompts, [])
    emitted = {t for out in free_run for t in out}
    never = next(t for t in range(VOCAB - 1, 0, -1) if t not in emitted)
    # The first token of the second prompt's output that is new at step 3 or later.
    out1 = free_run[1]
    stop = next((t for k, t in enumerate(out1) if k >= 3 and t not in out1[:k]), out1[-1])
    eos_ids = [never, stop]

    directory = os.path.join(OUT, name)
    shutil.rmtree(directory, ignore_errors=True)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=eos_ids, pad_token_id=0)
    kw = {"max_shard_size": spec["shard"]} if spec["shard"] else {}
    model.save_pretrained(directory, **kw)
    if name == "llama3":
        write_tokenizer(directory)

    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    with torch.no_grad():
        logits = loaded(torch.tensor([LOGITS_PROMPT])).logits[0].float().numpy()
    outputs, gen_margin = greedy(loaded, prompts, eos_ids)
    smallest = min(gen_margin, margin(torch.from_numpy(logits)))
    if smallest < MIN_MARGIN:
        raise SystemExit(f"{name}: top-2 logit margin {smallest:.2e} < {MIN_MARGIN}: near-tie; "
                         f"change its seed")
    np.save(os.path.join(OUT, f"{name}.logits.npy"), logits.astype(np.float32))
    expected = {"transformers": transformers.__version__, "torch": torch.__version__,
                "logits_prompt": LOGITS_PROMPT, "prompts": prompts,
                "max_new_tokens": MAX_NEW_TOKENS, "eos_token_ids": eos_ids, "outputs": outputs,
                "min_top2_margin": smallest}
    with open(os.path.join(OUT, f"{name}.expected.json"), "w") as f:
        f.write("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in expected.items())
                + "\n}\n")
    size = sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))
    print(f"{name}: {size / 1024:.0f} KiB, outputs {[len(o) for o in outputs]}, "
          f"min margin {smallest:.3g}")
    return expected


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("families", nargs="*", metavar="FAMILY",
                   help=f"which to write (default: all of {', '.join(FAMILIES)})")
    args = p.parse_args()
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown}; choose from {list(FAMILIES)}")
    os.makedirs(OUT, exist_ok=True)
    torch.set_num_threads(1)
    for name in args.families or FAMILIES:
        make(name, FAMILIES[name])


if __name__ == "__main__":
    main()
