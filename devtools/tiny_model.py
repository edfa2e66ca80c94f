"""A tiny Llama with random weights and a word-level tokenizer, for a real vLLM on the CPU (tests/real/).

Its output is noise; what the tests need is vLLM's own scheduler, KV cache manager, prefix cache and
metrics under load, which a model this small drives within seconds on two cores. Hidden 128, 2 layers,
2 attention heads of 64 (a head size vLLM's CPU attention supports) sharing 1 KV head; every word of
the vocabulary is one token, so a prompt of N words is N tokens exactly (no BOS is added).

Run by devtools/vllm_engine.py inside the engine's virtual environment (.venv-vllm, which has torch and
transformers): `python devtools/tiny_model.py DIRECTORY`. Importing it needs the standard library only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
# The prompt vocabulary: every other token, each a word the tokenizer maps to one id.
WORDS = tuple(f"w{index:03d}" for index in range(len(SPECIAL_TOKENS), VOCAB_SIZE))
MAX_MODEL_LEN = 1024
SEED = 0
ARCHITECTURE = {
    "vocab_size": VOCAB_SIZE, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": MAX_MODEL_LEN,
    "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32", "tie_word_embeddings": False,
}
# Written last into the directory: a directory holding this same spec is reused as it is.
SPEC = json.dumps({"architecture": ARCHITECTURE, "special": SPECIAL_TOKENS, "seed": SEED}, sort_keys=True)
SPEC_FILE = "tiny-model-spec.json"


def is_made(directory: Path) -> bool:
    spec = directory / SPEC_FILE
    return spec.is_file() and spec.read_text() == SPEC


def make(directory: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    (directory / SPEC_FILE).unlink(missing_ok=True)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**ARCHITECTURE))
    model.save_pretrained(directory)
    vocab = {token: index for index, token in enumerate((*SPECIAL_TOKENS, *WORDS))}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", model_max_length=MAX_MODEL_LEN)
    tokenizer.save_pretrained(directory)
    (directory / SPEC_FILE).write_text(SPEC)


if __name__ == "__main__":
    make(Path(sys.argv[1]))
