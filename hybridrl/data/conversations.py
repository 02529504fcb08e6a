"""Supervised fine-tuning on multi-turn conversations (a `messages` column), tokenized the way rollouts are.

A row's `messages` is a whole conversation: user, assistant, tool results, assistant, ... ending with the
assistant's answer. The ids are built exactly as a multi-turn rollout builds an episode (`rollout/multiturn.py`),
so that SFT teaches the very sequences RL will sample and train on:

    prompt ids      = renderer.prompt_ids(messages before the first assistant turn)
    assistant turn  = tokenize(content)                  (+ the end-of-sequence id where the model stops: the last
                                                          turn, and a turn a user message answers)
    observation ids = renderer.observation_ids(...)      (the chat template's difference, as in a rollout)

Labels are the assistant turns' ids only (the loss mask of an episode); prompt and observations are
IGNORE_INDEX. A turn followed by tool results ended at the tool call's closing tag (a stop string), so it gets
no stop id: its closing is part of the observation ids, as in a rollout. A turn followed by a user message ended on
the stop id, so SFT teaches the model to stop there (without it, the model never learns to hand the turn back).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridrl.data.datasets import IGNORE_INDEX, DataError, SFTDataset, read_records
from hybridrl.envs.base import Message
from hybridrl.envs.rendering import ChatTemplateError, ObservationRenderer
from hybridrl.envs.sandbox import python as python_tool
from hybridrl.envs.tools import load_tool, tool_schema

logger = logging.getLogger(__name__)

MESSAGES_KEY = "messages"


def conversation_item(renderer: ObservationRenderer, messages: Sequence[Message], stop_id: int) -> dict[str, list[int]]:
    """{"input_ids", "labels"} of one conversation, token-exactly as a rollout would hold it."""
    roles = [message.get("role") for message in messages]
    if "assistant" not in roles or roles[-1] != "assistant":
        raise ValueError("a conversation must end with the assistant's answer (its last message has role "
                         f"'assistant'); got roles {roles}.")
    first = roles.index("assistant")
    if first == 0:
        raise ValueError("a conversation must open with at least one message before the assistant's first turn.")
    input_ids = renderer.prompt_ids(messages[:first])
    labels = [IGNORE_INDEX] * len(input_ids)
    turn = first
    while turn < len(messages):
        following = next((i for i in range(turn + 1, len(messages)) if roles[i] == "assistant"), len(messages))
        # A turn ends on the stop id unless tool results follow it (that turn ended at the call's closing tag, a stop
        # string, and its closing belongs to the observation): the last turn, and one a user message answers.
        stops = following == len(messages) or roles[turn + 1] != "tool"
        sampled = renderer.encode(messages[turn]["content"]) + ([stop_id] if stops else [])
        input_ids += sampled
        labels += sampled
        if following < len(messages):
            if following == turn + 1:
                raise ValueError(f"messages {turn} and {following} are two assistant turns in a row; a tool result or "
                                 "user message must come between them.")
            observation = renderer.observation_ids(messages[:turn + 1], messages[turn + 1:following], sampled)
            input_ids += observation
            labels += [IGNORE_INDEX] * len(observation)
        turn = following
    return {"input_ids": input_ids, "labels": labels}


def tool_schemas(specs: Sequence[str]) -> list[dict[str, Any]]:
    """The JSON schemas of `env.tools` (`python` is the built-in sandboxed tool), as a rollout shows them."""
    return [tool_schema(python_tool if spec == "python" else load_tool(spec)[1], spec) for spec in specs]


class ConversationSFTDataset:
    """Conversations from the `messages` column; item i is {"input_ids", "labels"} like `SFTDataset`'s.
    Conversations longer than `max_length` are dropped (`num_filtered`)."""

    def __init__(self, source: Any, tokenizer: Any, tools: Sequence[dict[str, Any]] | None = None,
                 system_prompt: str = "", max_length: int = 512):
        rows = read_records(source)
        name = f"data file '{source}'" if isinstance(source, (str, Path)) else "the given records"
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no end-of-sequence token, so the last assistant turns cannot be "
                            "ended; set tokenizer.eos_token.")
        try:
            renderer = ObservationRenderer(tokenizer, tools=tools)
        except ChatTemplateError as error:
            raise DataError(f"SFT on the '{MESSAGES_KEY}' column of {name}: {error}") from None
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        items = []
        for index, row in enumerate(rows):
            messages = row.get(MESSAGES_KEY)
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise DataError(f"row {index} of {name} has no list of messages in '{MESSAGES_KEY}'; give every row "
                                "a conversation as [{\"role\": ..., \"content\": ...}, ...].")
            if system and messages and messages[0].get("role") != "system":
                messages = system + messages  # as the tool environment's reset() opens an episode
            try:
                items.append(conversation_item(renderer, messages, tokenizer.eos_token_id))
            except (ValueError, KeyError) as error:
                raise DataError(f"row {index} of {name}: {error}") from None
        self.items = [item for item in items if len(item["input_ids"]) <= max_length]
        self.num_filtered = len(items) - len(self.items)
        """Conversations dropped for being longer than `max_length` tokens."""
        if not self.items:
            raise DataError(f"all {len(items)} conversations in {name} are longer than {max_length} tokens; raise "
                            "sft.max_length.")
        if self.num_filtered:
            logger.warning("dropped %d of %d SFT conversations in %s longer than %d tokens (sft.max_length)",
                           self.num_filtered, len(items), name, max_length)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.items[index]


def sft_dataset(config: Any, tokenizer: Any, path: Any) -> SFTDataset | ConversationSFTDataset:
    """The SFT data of `path`: conversations when its rows have a `messages` column (rendered with `env.tools`'
    schemas and `env.system_prompt`, as rollouts are), else prompt/response pairs."""
    if any(MESSAGES_KEY in row for row in read_records(path)):
        env = config.env
        return ConversationSFTDataset(path, tokenizer, tools=tool_schemas(env.tools) if env.tools else None,
                                      system_prompt=env.system_prompt, max_length=config.sft.max_length)
    return SFTDataset.from_config(config.data, config.sft, tokenizer, path)
