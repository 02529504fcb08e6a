"""Token-exact observations: the ids a new message adds to a conversation, by the chat template's own rendering.

After an assistant turn, the engine holds the prompt ids and the ids it sampled. An observation (tool results, a
user reply) must be appended as ids without touching those: re-tokenizing the assistant's text could give other
ids than the ones sampled (BPE merges differ), and the trainer would then train on tokens the policy never
produced. So the observation's ids are computed as a difference of renderings:

    P = render(messages before the assistant turn, generation prompt)      ends where sampling began
    A = render(messages with the assistant turn)                            P + assistant text + closing
    B = render(messages with the assistant turn and the observation, generation prompt)
    observation ids = tokenize(closing + B[len(A):])

where `closing` is what the template writes after the assistant's text (e.g. `<|im_end|>\n`), less the stop
token the model already sampled. Only this difference is tokenized; the sampled ids are appended as they are.

Choices:
- The difference is taken on text, which needs a template that renders earlier turns the same way when a
  message is added (prefix-stable) and writes the assistant's text verbatim; both are checked on every call and
  a template that breaks them is refused with one sentence, never silently re-tokenized.
- A template without a `tool` role is refused when the renderer is made, before any model runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridrl.envs.base import Message

_PROBE = "hybridrl-tool-role-probe-7c1f"


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot render observations token-exactly; the message says the fix."""


class ObservationRenderer:
    """Renders prompts and observations to ids through `tokenizer.apply_chat_template` (with `tools`, the JSON
    schemas shown to the model, passed to every rendering so the system block is the same each time)."""

    def __init__(self, tokenizer: Any, tools: Sequence[dict[str, Any]] | None = None,
                 **template_kwargs: Any):
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.template_kwargs = template_kwargs
        self._special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._check_template()

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))  # the template wrote the special tokens

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The ids of the first messages with the generation prompt: where the first assistant turn begins."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def observation_ids(self, messages: Sequence[Message], new_messages: Sequence[Message],
                        sampled_ids: Sequence[int] | None = None) -> list[int]:
        """The ids to append after the sampled ids of the last assistant turn so that the sequence continues with
        `new_messages` and the generation prompt of the next assistant turn.

        `messages` is the conversation so far, ending with the assistant message whose content is the sampled
        text (decoded without its stop token). `sampled_ids` are that turn's ids: when the last one is a special
        token that the template's closing begins with (the stop token, e.g. `<|im_end|>`), it is not repeated."""
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("observation_ids needs the conversation to end with the assistant turn it follows.")
        if not new_messages:
            raise ValueError("observation_ids needs at least one new message (a tool result or a user turn).")
        before = self.render(messages[:-1], add_generation_prompt=True)
        with_assistant = self.render(messages, add_generation_prompt=False)
        after = self.render([*messages, *new_messages], add_generation_prompt=True)
        content = messages[-1]["content"]
        if not after.startswith(with_assistant):
            raise ChatTemplateError("the chat template renders earlier turns differently once a message is added "
                                    "(it is not prefix-stable), so observation ids cannot be found by difference; "
                                    "use a template that renders each message independently of later ones.")
        if not with_assistant.startswith(before + content):
            raise ChatTemplateError("the chat template does not write the assistant's text verbatim after its "
                                    "generation prompt (it rewrites the turn, e.g. strips reasoning or whitespace), "
                                    "so observation ids cannot be found by difference; use a template that keeps "
                                    "assistant content as it is.")
        closing = with_assistant[len(before) + len(content):]
        closing = closing[len(self._sampled_stop_text(sampled_ids, closing)):]
        return self.encode(closing + after[len(with_assistant):])

    def next_turn_opening(self, conversation: Sequence[Message]) -> list[int]:
        """The ids the template writes after the content of the conversation's last message up to where the next
        assistant turn begins: that message's closing and the generation prompt (e.g. `<|im_end|>\n<|im_start|>
        assistant\n`). A truncated observation ends with them, so that the model's next turn opens as it would
        have. Only the generation prompt when the last content does not appear verbatim in the rendering."""
        text = self.render(conversation, add_generation_prompt=True)
        content = conversation[-1].get("content", "") if conversation else ""
        at = text.rfind(content) if content else -1
        if at < 0:
            at, content = len(self.render(conversation, add_generation_prompt=False)), ""
        return self.encode(text[at + len(content):])

    def _sampled_stop_text(self, sampled_ids: Sequence[int] | None, closing: str) -> str:
        if not sampled_ids or sampled_ids[-1] not in self._special_ids:
            return ""
        stop = self.tokenizer.decode([sampled_ids[-1]], skip_special_tokens=False)
        return stop if stop and closing.startswith(stop) else ""

    def _check_template(self) -> None:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ChatTemplateError("the tokenizer has no chat template, which multi-turn episodes need to render "
                                    "observations; set tokenizer.chat_template (e.g. the model's own tool-calling "
                                    "template).")
        conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "calling"}]
        tool = {"role": "tool", "name": "probe", "content": _PROBE}
        try:
            text = self.render([*conversation, tool], add_generation_prompt=True)
        except Exception as error:  # templates refuse unknown roles with raise_exception
            raise ChatTemplateError(f"the tokenizer's chat template cannot render a 'tool' message ({error}); use "
                                    "the model's tool-calling chat template or set tokenizer.chat_template to one "
                                    "with a tool role.") from error
        if _PROBE not in text:
            raise ChatTemplateError("the tokenizer's chat template drops 'tool' messages (it has no tool role); use "
                                    "the model's tool-calling chat template or set tokenizer.chat_template to one "
                                    "with a tool role.")
