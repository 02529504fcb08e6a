"""A new user's path on a task of their own: a JSONL of prompts and answers, a reward file with partial credit, a
YAML config, `hybridrl train`; the summary at the end shows exact-match accuracy and each reward's held-out mean,
before and after, as the metrics file recorded them."""

from __future__ import annotations

import json
import textwrap

from hybridrl.cli import main

REWARD_FILE = '''
def partial_credit(prompts, completions, answer, **columns):
    """1 for the exact answer, 0.5 for an answer that contains it, 0.1 for any digit at all."""
    scores = []
    for completion, expected in zip(completions, answer):
        text = completion.strip()
        scores.append(1.0 if text == expected else 0.5 if expected in text else
                      0.1 if any(c.isdigit() for c in text) else 0.0)
    return scores
'''


def test_a_new_users_task_trains_and_the_summary_shows_exact_match_and_each_reward(tmp_path, capsys):
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(6) for b in range(6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:12]))
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    (tmp_path / "my_task.yaml").write_text(textwrap.dedent(f"""
        model: {{path: "tiny:llama"}}
        data: {{train_path: {tmp_path / 'train.jsonl'}, eval_path: {tmp_path / 'held_out.jsonl'},
               prompt_key: question, max_prompt_length: 16}}
        rollout: {{num_samples_per_prompt: 4, max_new_tokens: 4}}
        reward:
          functions:
            - fn: {tmp_path / 'my_rewards.py'}:partial_credit
            - fn: exact_match
        actor: {{lr: 1.0e-3, micro_batch_size: 16}}
        trainer: {{total_steps: 3, prompts_per_step: 4, eval_every: 3, device: cpu, save_model: false,
                  output_dir: {tmp_path / 'run'}}}
        logging: {{sinks: [console, jsonl], num_samples_to_print: 0}}
    """))
    assert main(["train", str(tmp_path / "my_task.yaml")]) == 0
    out = capsys.readouterr().out
    summary = out[out.index("== grpo summary"):].splitlines()
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    before, after = history[0], history[-1]
    assert before["step"] == 0 and after["step"] == 3  # held-out evaluation before step 1 and after the last
    assert summary[1] == (f"  eval/accuracy: {before['eval/accuracy']:.1%} -> {after['eval/accuracy']:.1%} "
                          f"({(after['eval/accuracy'] - before['eval/accuracy']) * 100:+.1f} points)")
    for name in ("partial_credit", "exact_match"):
        key = f"eval/reward/{name}"
        assert f"  {key}: {before[key]:.4g} -> {after[key]:.4g}" in summary
    assert f"  eval/reward_mean: {before['eval/reward_mean']:.4g} -> {after['eval/reward_mean']:.4g}" in summary
    assert any(line.startswith("  3 steps in ") for line in summary)
    assert any("metrics: " in line and "hybridrl plot" in line for line in summary)
