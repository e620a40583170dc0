"""A tiny, randomly initialized Qwen2 model built on the spot, for real vLLM runs on CPU.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a few
lines of local text (so any text still encodes), the weights are random. The
model writes nonsense, which is the point: structured decoding must still yield
valid plans, and the free mode must cope with garbage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

# ChatML, as Qwen2 uses; the generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = """\
You are the planner. Write a workflow of steps for the workers in the pool.
{"steps": [{"worker": "solver-a", "instruction": "Solve the problem step by step.", "access": []},
{"worker": "checker-b", "instruction": "Check the solution above.", "access": [0]},
{"worker": "vote", "instruction": "Pick the majority answer.", "access": "all"}]}
model_id = ["solver-a", 1, "vote"]
subtasks = ["Solve it.", "Verify it.", "Decide."]
access_list = [[], [0], ["all"]]
Answer: 42. Answer: B. Answer: Paris.
What is 17 * 23? Which option is correct: A, B, C or D? Name the capital of France.
0 1 2 3 4 5 6 7 8 9 10 11 12 100 2024 3.14 -7 1/2 x + y = z
abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ
{ } [ ] ( ) < > " ' : ; , . ! ? - _ + * / = % & | \\ ^ ~ ` @ # $
math choice exact worker instruction access steps all none llm function planner
solver verifier checker aggregator extract vote gpt qwen llama mistral small large mini
"""


def build_tiny_qwen2(directory: str | Path, *, vocab_size: int = 2048, hidden_size: int = 64,
                     layers: int = 2, heads: int = 2, extra_text: Iterable[str] = (),
                     seed: int = 0) -> Path:
    """Write config, tokenizer and random safetensors weights to `directory`; return it.

    head_dim = hidden_size / heads must be at least 32: the CPU attention
    kernels reject 16.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    if hidden_size // heads < 32:
        raise ValueError(f"head_dim {hidden_size // heads} is below 32; vLLM's CPU attention needs >= 32")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_CORPUS, *extra_text] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(out)

    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    head_dim = hidden_size // heads
    config = Qwen2Config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]}))
    return out


if __name__ == "__main__":
    import sys

    print(build_tiny_qwen2(sys.argv[1] if len(sys.argv) > 1 else "tiny-qwen2"))
