"""Conversation -> (input_ids, loss_mask) through a chat template.

The template is the tokenizer's own (``target.chat_template: auto``) or one of
TEMPLATES below. The loss mask is found by rendering prefix by prefix: the
assistant turn i spans from the end of ``render(messages[:i], generation
prompt)`` to the end of its end-of-turn token in ``render(messages[:i+1])``.
The whole text is then tokenized once and every token whose characters fall
in such a span is marked 1. Template text (role headers, the newline after
the end-of-turn token) stays 0; the end-of-turn token itself is 1, because
the target generates it.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("system", "user", "assistant")

# Kimi-K2's layout (Moonshot's tiktoken tokenizer names these special tokens).
KIMI_K2_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_system|>system<|im_middle|>"
    "{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class NamedTemplate:
    jinja: str
    end_of_turn: str  # the token that closes an assistant turn (generation stops on it)
    special_tokens: tuple[str, ...]  # tokens the tokenizer must know as single special tokens


TEMPLATES: dict[str, NamedTemplate] = {
    "chatml": NamedTemplate(CHATML_TEMPLATE, "<|im_end|>", ("<|im_start|>", "<|im_end|>")),
    "kimi-k2": NamedTemplate(
        KIMI_K2_TEMPLATE,
        "<|im_end|>",
        ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"),
    ),
}


class ChatTemplateError(ValueError):
    """A template that cannot be used to mask assistant turns."""


class ChatFormat:
    """Renders and tokenizes conversations for one tokenizer and template."""

    def __init__(self, tokenizer, template: str = "auto"):
        self.tokenizer = tokenizer
        if template == "auto":
            if not getattr(tokenizer, "chat_template", None):
                raise ChatTemplateError(
                    "the tokenizer has no chat template; set target.chat_template to one of " + ", ".join(TEMPLATES)
                )
            self.jinja = None
            self.end_of_turn = tokenizer.eos_token
        elif template in TEMPLATES:
            named = TEMPLATES[template]
            unknown = [t for t in named.special_tokens if t not in tokenizer.get_vocab()]
            if unknown:
                raise ChatTemplateError(f"template {template!r} needs special tokens the tokenizer lacks: {unknown}")
            self.jinja = named.jinja
            self.end_of_turn = named.end_of_turn
        else:
            raise ChatTemplateError(f"unknown chat template {template!r} (known: auto, {', '.join(TEMPLATES)})")
        self.template = template
        eot_id = tokenizer.convert_tokens_to_ids(self.end_of_turn)
        self.stop_ids = sorted({i for i in (eot_id, tokenizer.eos_token_id) if i is not None and i >= 0})

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.jinja, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def assistant_spans(self, messages: list[dict], text: str) -> list[tuple[int, int]]:
        """Character spans of each assistant turn in `text`, end-of-turn token included."""
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            head = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            if not (text.startswith(head) and text.startswith(upto) and upto.startswith(head)):
                raise ChatTemplateError(
                    f"template {self.template!r} does not render conversations prefix by prefix (turn {i})"
                )
            end = upto.rfind(self.end_of_turn, len(head))
            end = end + len(self.end_of_turn) if end >= 0 else len(upto.rstrip())
            spans.append((len(head), end))
        return spans

    def encode(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
        """Token ids and loss mask (1 on assistant tokens incl. end-of-turn) of a whole conversation."""
        text = self.render(messages, add_generation_prompt)
        spans = self.assistant_spans(messages, text)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [0] * len(ids)
        for t, (a, b) in enumerate(enc["offset_mapping"]):
            if any(a < e and b > s for s, e in spans):
                mask[t] = 1
        return ids, mask

    def next_turn_ids(self, messages: list[dict]) -> list[int]:
        """Ids that follow an assistant turn's end-of-turn token when the user speaks next.

        `messages` ends with [..., assistant, user]. Returns the template's text after that
        assistant turn's end-of-turn token, the user turn and the generation prompt, tokenized
        alone, so a regenerated conversation keeps the target's own answer ids as they were
        generated (no detokenize/retokenize round trip).
        """
        if len(messages) < 2 or messages[-1]["role"] != "user" or messages[-2]["role"] != "assistant":
            raise ChatTemplateError("next_turn_ids needs messages ending with an assistant turn, then a user turn")
        head = self.render(messages[:-1])
        full = self.render(messages, add_generation_prompt=True)
        cut = head.rfind(self.end_of_turn)
        if cut < 0 or not full.startswith(head):
            raise ChatTemplateError(f"template {self.template!r} does not render conversations prefix by prefix")
        tail = full[cut + len(self.end_of_turn) :]
        return list(self.tokenizer(tail, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids without the stop token(s)."""
        return self.tokenizer.decode([i for i in ids if i not in self.stop_ids], skip_special_tokens=False)
