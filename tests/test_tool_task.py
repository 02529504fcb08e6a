"""The tool task and SFT on conversations: the task's data, the built-in calc tool, the tiny chat template, and
SFT sequences that equal, id for id and mask for mask, the episodes a rollout builds from the same turns."""

from __future__ import annotations

import json

import pytest
from test_multiturn import TEMPLATE as QWEN_TEMPLATE  # a Qwen2.5-style template with a tool role

from hybridrl.config.loading import load_config
from hybridrl.data.conversations import ConversationSFTDataset, conversation_item, sft_dataset
from hybridrl.data.datasets import IGNORE_INDEX, DataError, SFTDataset
from hybridrl.data.tool_task import multiplication_problems, teacher_messages, tool_call_text, write_tool_task
from hybridrl.envs import StepResult  # the public name the environment errors point users to
from hybridrl.envs.builtin_tools import BUILTIN_TOOLS, calc
from hybridrl.envs.rendering import ObservationRenderer
from hybridrl.envs.tools import ToolBox, ToolCall, ToolCallFormat, parse_tool_calls
from hybridrl.models.loading import CHAR_CHAT_TEMPLATE, ModelError, build_char_tokenizer, build_tiny_model
from hybridrl.rollout.base import Generation, SamplingParams
from hybridrl.rollout.multiturn import EpisodeBudget, generate_episodes_reference, make_sessions

CALC = f"{BUILTIN_TOOLS}:calc"
FORMAT = ToolCallFormat("[[", "]]")


def qwen_style_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"  # what Qwen2.5-Instruct's tokenizer stops at
    tokenizer.chat_template = QWEN_TEMPLATE
    return tokenizer


class ScriptedBackend:
    """A backend whose turns are given texts: what a policy that wrote exactly the teacher's turns would sample."""

    def __init__(self, tokenizer, turns: list[list[str]]):
        self.tokenizer, self.turns = tokenizer, turns
        self.calls = 0

    def generate(self, prompts, params):
        out = []
        for index, _ in enumerate(prompts):
            text = self.turns[index][self.calls]
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            stopped_by_tag = text.endswith(tuple(params.stop_strings))
            ids = ids if stopped_by_tag else ids + [self.tokenizer.eos_token_id]
            out.append(Generation(index, ids, [-0.5] * len(ids), "stop"))
        self.calls += 1
        return out


@pytest.mark.parametrize("make_tokenizer, tags", [
    (lambda: build_char_tokenizer(chat_template=CHAR_CHAT_TEMPLATE), ("[[", "]]")),
    (qwen_style_tokenizer, ("<tool_call>", "</tool_call>")),
])
def test_sft_conversation_equals_the_rollout_episode(make_tokenizer, tags):
    """The SFT ids of a teacher conversation are the ids and mask of the episode a rollout builds when the policy
    samples the teacher's turns and the real calc tool answers (would fail on any re-tokenization or a stop id
    in the wrong place)."""
    tokenizer = make_tokenizer()
    problems = [(123, 45), (908, 17)]
    conversations = [teacher_messages(a, b, use_tool=True, start=tags[0], end=tags[1]) for a, b in problems]
    with ToolBox([CALC], format=ToolCallFormat(*tags), max_turns=3, num_workers=1) as toolbox:
        renderer = ObservationRenderer(tokenizer, tools=toolbox.schemas)
        backend = ScriptedBackend(tokenizer, [[m["content"] for m in c if m["role"] == "assistant"]
                                              for c in conversations])
        params = SamplingParams(max_new_tokens=80, temperature=0.0, stop_strings=[tags[1]])
        sessions = make_sessions(toolbox, [{"prompt": f"{a}*{b}"} for a, b in problems], n=1, name="calc")
        episodes = generate_episodes_reference(backend, sessions, renderer, params, EpisodeBudget(max_turns=3),
                                               {tokenizer.eos_token_id})
    for episode, conversation in zip(episodes, conversations):
        assert episode.messages == conversation  # the same turns, the real tool's result
        item = conversation_item(renderer, conversation, tokenizer.eos_token_id)
        assert item["input_ids"] == episode.token_ids
        assert [int(label != IGNORE_INDEX) for label in item["labels"]] == episode.loss_mask
        assert [label for label in item["labels"] if label != IGNORE_INDEX] == \
            [t for t, m in zip(episode.token_ids, episode.loss_mask) if m]


def test_conversation_item_by_hand_on_the_tiny_template():
    tokenizer = build_char_tokenizer(chat_template=CHAR_CHAT_TEMPLATE)
    renderer = ObservationRenderer(tokenizer)
    item = conversation_item(renderer, teacher_messages(12, 3, use_tool=True), tokenizer.eos_token_id)
    text = tokenizer.decode(item["input_ids"], skip_special_tokens=False)
    call = '[[{"name":"calc","arguments":{"expr":"12*3"}}]]'
    assert text == f"Q12*3\nA{call}<eos>R36\nA 36<eos>"
    trained = tokenizer.decode([t for t in item["labels"] if t != IGNORE_INDEX], skip_special_tokens=False)
    assert trained == f"{call} 36<eos>"  # the tool call and the answer with its stop; not the observation's <eos>
    head = conversation_item(renderer, teacher_messages(12, 3, use_tool=False), tokenizer.eos_token_id)
    assert tokenizer.decode(head["input_ids"], skip_special_tokens=False) == "Q12*3\nA 30<eos>"  # 12 rounded: 10*3


def test_conversation_mistakes_are_one_sentence(tmp_path):
    tokenizer = build_char_tokenizer(chat_template=CHAR_CHAT_TEMPLATE)
    user = {"role": "user", "content": "1*2"}
    with pytest.raises(DataError, match="must end with the assistant"):
        ConversationSFTDataset([{"messages": [user]}], tokenizer)
    with pytest.raises(DataError, match="two assistant turns in a row"):
        ConversationSFTDataset([{"messages": [user, {"role": "assistant", "content": "a"},
                                              {"role": "assistant", "content": "b"}]}], tokenizer)
    with pytest.raises(DataError, match="no list of messages"):
        ConversationSFTDataset([{"messages": "1*2"}], tokenizer)
    with pytest.raises(DataError, match="no chat template"):
        ConversationSFTDataset([{"messages": [user, {"role": "assistant", "content": "2"}]}], build_char_tokenizer())


def test_system_prompt_and_length_filter():
    tokenizer = build_char_tokenizer(chat_template=CHAR_CHAT_TEMPLATE)
    rows = [{"messages": teacher_messages(123, 45, use_tool=True)}, {"messages": teacher_messages(1, 2, False)}]
    data = ConversationSFTDataset(rows, tokenizer, system_prompt="be exact", max_length=40)
    assert len(data) == 1 and data.num_filtered == 1
    assert tokenizer.decode(data[0]["input_ids"], skip_special_tokens=False) == "Sbe exact\nQ1*2\nA 0<eos>"


def test_sft_dataset_picks_conversations_by_column(tmp_path):
    paths = write_tool_task(tmp_path, num_train=20, num_eval=5, tool_rate=0.5)
    config = load_config(None, [f"env.tools=[{CALC}]", "env.tool_call_start=[[", "env.tool_call_end=]]"])
    tokenizer = build_char_tokenizer(chat_template=CHAR_CHAT_TEMPLATE)
    assert isinstance(sft_dataset(config, tokenizer, paths["sft"]), ConversationSFTDataset)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n")
    assert isinstance(sft_dataset(config, tokenizer, pairs), SFTDataset)


def test_tool_task_files(tmp_path):
    paths = write_tool_task(tmp_path, num_train=200, num_eval=50, seed=3, tool_rate=0.5)
    read = {split: [json.loads(line) for line in path.open()] for split, path in paths.items()}
    assert len(read["train"]) == len(read["sft"]) == 200 and len(read["eval"]) == 50
    assert {row["prompt"] for row in read["train"]}.isdisjoint(row["prompt"] for row in read["eval"])
    assert all(set(row) == {"prompt", "answer"} for row in read["train"] + read["eval"])  # no messages for RL
    for row, sft in zip(read["train"], read["sft"]):
        a, b = map(int, row["prompt"].split("*"))
        assert 100 <= a <= 999 and 10 <= b <= 99 and row["answer"] == sft["answer"] == str(a * b)
        assert sft["messages"][0] == {"role": "user", "content": row["prompt"]}
    with_tool = [sft for sft in read["sft"] if len(sft["messages"]) == 4]
    assert 70 <= len(with_tool) <= 130  # about half, drawn per problem
    assert all(m["messages"][-1]["content"] == f" {m['answer']}" for m in with_tool)
    head = [sft for sft in read["sft"] if len(sft["messages"]) == 2]
    wrong = sum(m["messages"][-1]["content"].strip() != m["answer"] for m in head)
    assert wrong >= 0.8 * len(head)  # in its head the teacher is usually wrong
    with pytest.raises(ValueError, match="between 0 and 1"):
        write_tool_task(tmp_path, num_train=2, num_eval=1, tool_rate=1.5)
    assert len(set(multiplication_problems(500, seed=0))) == 500


def test_calc_tool_and_its_call_format():
    assert calc("123*45") == 5535 and calc(" 7 - 9") == -2 and calc("2+2") == 4
    for bad in ("2**100", "1+2+3", "import os", 12):
        with pytest.raises(ValueError, match="two integers with"):
            calc(bad)
    [call] = parse_tool_calls(tool_call_text(123, 45), FORMAT)
    assert call == ToolCall("calc", {"expr": "123*45"})
    with ToolBox([CALC], format=FORMAT, num_workers=1) as toolbox:
        assert toolbox.schemas[0]["function"]["name"] == "calc"
        assert toolbox.call(call).text == "5535"


def test_tiny_chat_variant():
    _, tokenizer = build_tiny_model("llama+chat")
    assert tokenizer.chat_template == CHAR_CHAT_TEMPLATE
    ObservationRenderer(tokenizer)  # has a tool role, accepted
    assert build_tiny_model("llama").tokenizer.chat_template is None  # the arithmetic demo's prompts unchanged
    with pytest.raises(ModelError, match=r"\+chat"):
        build_tiny_model("llama+tools")


def test_called_tool_reward_is_the_tool_call_rate():
    from hybridrl.rewards import BUILTIN_REWARDS

    calls = [[], [{"name": "calc", "malformed": False, "error": True}], [{"name": "", "malformed": True}]]
    assert BUILTIN_REWARDS["called_tool"](["p"] * 3, ["c"] * 3, tool_calls=calls) == [0.0, 1.0, 0.0]


def test_tool_demo_pipeline_short(tmp_path):
    """The tool demo's stages, very short: data, SFT on conversations from the demo's config, GRPO on episodes with
    the shipped calc tool; the episodes call the tool (the SFT data always does) and the metrics are sane."""
    import torch

    from hybridrl.cli import DEMO_CONFIGS
    from hybridrl.training.sft import run_sft
    from hybridrl.training.trainer import RLTrainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = write_tool_task(tmp_path / "data", num_train=64, num_eval=8, tool_rate=1.0)
        tools = [f"env.tools=[{CALC}]"]
        sft_model = run_sft(load_config(DEMO_CONFIGS / "tools_sft.yaml", tools + [
            f"data.train_path={data['sft']}", f"data.eval_path={data['sft']}", "data.max_eval_samples=8",
            f"trainer.output_dir={tmp_path / 'sft'}", "sft.max_steps=40",
            "sft.batch_size=16", "sft.warmup_steps=5", "logging.sinks=[jsonl]"]))
        history = RLTrainer(load_config(DEMO_CONFIGS / "tools_grpo.yaml", tools + [
            f"data.train_path={data['train']}", f"data.eval_path={data['eval']}", f"model.path={sft_model}",
            f"trainer.output_dir={tmp_path / 'grpo'}", "trainer.total_steps=2", "trainer.prompts_per_step=2",
            "rollout.num_samples_per_prompt=4", "trainer.eval_every=2", "logging.sinks=[jsonl]"])).train()
    finally:
        torch.set_num_threads(threads)
    sft_evals = [row for row in map(json.loads, (tmp_path / "sft" / "metrics.jsonl").open()) if "eval/loss" in row]
    assert len(sft_evals) == 2 and sft_evals[-1]["eval/loss"] < sft_evals[0]["eval/loss"]  # conversations: loss only
    assert not any("eval/accuracy" in row for row in sft_evals)
    steps = [row for row in history if "rollout/tool_calls_per_episode" in row]
    evals = [row for row in history if "eval/accuracy" in row]
    assert len(steps) == 2 and len(evals) == 2  # before the first step and after the last
    assert all(row["rollout/tool_calls_per_episode"] > 0 for row in steps)
    assert all(1.0 <= row["rollout/turns_per_episode"] <= 2.0 for row in steps)
    assert all(0.0 <= row["reward/mean"] <= 1.0 and 0.0 <= row["reward/called_tool"] <= 1.0 for row in steps)
    assert all(0.0 <= row["eval/accuracy"] <= 1.0 and 0.0 <= row["eval/reward/called_tool"] <= 1.0 for row in evals)


def test_make_data_and_demo_command_lines(tmp_path, capsys):
    from hybridrl.cli import main

    assert main(["make-data", "--task", "tools", str(tmp_path), "--num-train", "20", "--num-eval", "5"]) == 0
    assert [sum(1 for _ in (tmp_path / name).open()) for name in ("sft.jsonl", "eval.jsonl")] == [20, 5]
    assert main(["demo", "--task", "tools", "--algorithm", "ppo", "--out-dir", str(tmp_path / "demo")]) == 2
    assert "runs GRPO only" in capsys.readouterr().err and not (tmp_path / "demo").exists()


class FollowUpEnvironment:
    """Asks a question, then a follow-up once the first answer comes: a conversation with a user turn mid-way."""

    def __init__(self, row):
        self.row, self.steps = row, 0

    def reset(self):
        return [{"role": "user", "content": self.row["prompt"]}]

    def step(self, text):
        self.steps += 1
        if self.steps == 1:
            return StepResult(observation=[{"role": "user", "content": "and +1?"}])
        return StepResult(reward=1.0, done=True)


@pytest.mark.parametrize("make_tokenizer", [lambda: build_char_tokenizer(chat_template=CHAR_CHAT_TEMPLATE),
                                            qwen_style_tokenizer])
def test_sft_conversation_with_a_user_follow_up_teaches_the_stop_the_rollout_samples(make_tokenizer):
    """A turn a user message answers ended on the stop id in the rollout, so the SFT ids and labels carry that stop
    id in the loss (it failed before: SFT left it out, so no model learnt to hand a turn back to the user)."""
    tokenizer = make_tokenizer()
    conversation = [{"role": "user", "content": "12*3"}, {"role": "assistant", "content": "36"},
                    {"role": "user", "content": "and +1?"}, {"role": "assistant", "content": "37"}]
    renderer = ObservationRenderer(tokenizer)
    backend = ScriptedBackend(tokenizer, [["36", "37"]])
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    sessions = make_sessions(FollowUpEnvironment, [{"prompt": "12*3"}], n=1, name="follow-up")
    episode, = generate_episodes_reference(backend, sessions, renderer, params, EpisodeBudget(max_turns=3),
                                           {tokenizer.eos_token_id})
    assert episode.messages == conversation
    item = conversation_item(renderer, conversation, tokenizer.eos_token_id)
    assert item["input_ids"] == episode.token_ids
    assert [int(label != IGNORE_INDEX) for label in item["labels"]] == episode.loss_mask
    trained = [label for label in item["labels"] if label != IGNORE_INDEX]
    assert trained.count(tokenizer.eos_token_id) == 2  # both turns end on the stop id, both in the loss
