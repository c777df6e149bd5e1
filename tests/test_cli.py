"""CLI in-process: exit codes and messages of run / validate / ls / cp."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import write_jsonl

from finetune.cli.commands import main
from finetune.hardware import cpu_has_native_bf16


def write_recipe(tmp_path, data: dict, name="r.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_ls_lists_shipped_recipes(capsys):
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    assert "demo-cpu" in out and "CPU demo" in out
    assert "qlora-1x24gb" in out and "24 GB" in out


def test_cp_copies_and_refuses_to_clobber(tmp_path, capsys):
    dest = tmp_path / "mine.yaml"
    assert main(["cp", "qlora-1x24gb", str(dest)]) == 0
    assert dest.read_text().startswith("# finetune run")
    assert main(["cp", "qlora-1x24gb", str(dest)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["cp", "qlora-1x24gb", str(dest), "--force"]) == 0
    assert main(["cp", "demo-cpo", str(tmp_path / "x.yaml")]) == 2
    assert "did you mean 'demo-cpu'" in capsys.readouterr().err


def test_validate_valid_recipe(recipe_dict, tmp_path, capsys):
    assert main(["validate", write_recipe(tmp_path, recipe_dict)]) == 0
    assert "valid (precision fp32)" in capsys.readouterr().out


def test_validate_lists_all_problems_at_once(recipe_dict, tmp_path, capsys):
    wrong_cols = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "a"}])
    bad = {
        **recipe_dict,
        "model": {"path": str(tmp_path / "no-such-model")},
        "data": {"path": str(wrong_cols), "format": "alpaca", "eval_path": str(tmp_path / "missing.jsonl")},
    }
    assert main(["validate", write_recipe(tmp_path, bad)]) == 2
    err = capsys.readouterr().err
    assert "3 problems" in err, err
    assert "model.path:" in err and "no-such-model" in err
    assert "data.path:" in err and "found columns: question, answer" in err
    assert "data.eval_path:" in err and "missing.jsonl" in err and "cwd" in err


def test_validate_schema_errors_exit_2_with_suggestion(recipe_dict, tmp_path, capsys):
    rc = main(["validate", write_recipe(tmp_path, recipe_dict), "train.lrr=1", "lora.rank=4"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "train.lrr: unknown key; did you mean 'train.lr'?" in err
    assert "lora.rank: unknown key; did you mean 'lora.r'?" in err
    assert "Traceback" not in err


def test_a_typo_in_a_required_section_gets_its_did_you_mean_and_nothing_else(tmp_path, monkeypatch, capsys):
    from finetune.config.schema import find_recipe

    monkeypatch.chdir(tmp_path)  # demo-cpu's output_dir, runs/demo-cpu, is relative: a fresh one here
    source = find_recipe("demo-cpu")
    assert main(["validate", "demo-cpu", "data.formt=alpaca"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{source}: 1 problem",
        "  - data.formt: unknown key; did you mean 'data.format'?",
    ]
    assert main(["validate", "demo-cpu", "model.pth=x", "data.mix=[{path: 'asset:demo/train.jsonl', formt: alpaca}]"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{source}: 2 problems",
        "  - model.pth: unknown key; did you mean 'model.path'?",
        "  - data.mix.0.formt: unknown key; did you mean 'data.mix.0.format'?",
    ]


def test_a_corrupt_config_json_is_a_model_problem_not_a_tokenizer_one(recipe_dict, tiny_model_dir, tmp_path, capsys):
    import shutil

    from finetune.model.load import DAMAGED_CONFIG_HINT

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text('{"model_type": "lla')  # cut short, as by a failed copy
    assert main(["validate", write_recipe(tmp_path, {**recipe_dict, "model": {"path": str(model)}})]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("r.yaml: 1 problem") and len(lines) == 2, lines
    assert lines[1].startswith(f"  - model.path: '{model / 'config.json'}' is not valid JSON (")
    assert lines[1].endswith(f"at line 1, column 16); {DAMAGED_CONFIG_HINT}.")


def test_validate_4bit_without_adapter(recipe_dict, tmp_path, capsys):
    assert main(["validate", write_recipe(tmp_path, recipe_dict), "quant.bits=4", "lora=null"]) == 2
    assert "quant.bits=4 needs an adapter" in capsys.readouterr().err


@pytest.mark.skipif(cpu_has_native_bf16(), reason="this CPU has native bf16")
def test_bf16_on_cpu_without_it_is_refused(recipe_dict, tmp_path, capsys):
    assert main(["validate", write_recipe(tmp_path, recipe_dict), "precision=bf16"]) == 2
    err = capsys.readouterr().err
    assert "precision: precision=bf16 requested but this CPU has no native bf16" in err and "precision=auto" in err


def test_empty_dataset_and_malformed_file(recipe_dict, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["validate", write_recipe(tmp_path, recipe_dict), f"data.path={empty}"]) == 2
    assert "empty" in capsys.readouterr().err
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"instruction": "a", "output": "b"}\n{"instruction": \n')
    assert main(["validate", write_recipe(tmp_path, recipe_dict), f"data.path={broken}"]) == 2
    assert "line 2" in capsys.readouterr().err


def test_run_then_refuse_to_clobber_then_overwrite(recipe_dict, tmp_path, capsys):
    recipe = write_recipe(tmp_path, recipe_dict)
    assert main(["run", recipe, "--no-progress", "train.max_steps=2"]) == 0
    out = capsys.readouterr().out
    assert "done." in out and "adapter" in out
    run_dir = tmp_path / "run"
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]

    assert main(["run", recipe, "train.max_steps=2"]) == 2
    err = capsys.readouterr().err
    assert "holds another run" in err and "resume=auto" in err and "overwrite=true" in err
    assert main(["run", recipe, "train.max_steps=1", "overwrite=true", "--no-progress"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]


def test_debug_shows_traceback(tmp_path, capsys):
    assert main(["--debug", "validate", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "not found" in err


def test_missing_recipe_file(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert "recipe file" in err and "not found (cwd:" in err and "Traceback" not in err


def test_validate_finds_unknown_lora_target_without_loading_weights(recipe_dict, tmp_path, capsys):
    recipe = write_recipe(tmp_path, recipe_dict)
    assert main(["validate", recipe, "lora.target=[q_proj,qkv_proj]"]) == 2
    err = capsys.readouterr().err
    assert "lora.target: 'qkv_proj' match no module" in err
    assert "names from: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in err
    assert main(["validate", recipe, "lora.target=[q_proj,v_proj]"]) == 0


def test_validate_says_when_it_could_not_check_lora_target(recipe_dict, tiny_model_dir, tmp_path, capsys, monkeypatch):
    # A model whose class cannot be built on the meta device (here: from_config fails) is not checked silently.
    from finetune.model import vision

    class Unbuildable:
        @staticmethod
        def from_config(config, **kwargs):
            raise RuntimeError("no meta-device build for this class")

    monkeypatch.setattr(vision, "model_class", lambda config: Unbuildable)
    recipe = write_recipe(tmp_path, recipe_dict)
    assert main(["validate", recipe, "lora.target=[q_proj,qkv_proj]"]) == 0
    out = capsys.readouterr().out
    assert "lora.target not checked before loading" in out and "RuntimeError: no meta-device build for this class" in out


def test_validate_lists_schema_cross_field_and_file_problems_together(recipe_dict, tmp_path, capsys):
    recipe = write_recipe(tmp_path, recipe_dict)
    rc = main(
        ["validate", recipe, "train.lr=abc", "trian.x=1", "quant.bits=4", "lora=null", f"data.path={tmp_path / 'nope.jsonl'}"]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "4 problems" in err, err
    assert "train.lr:" in err and "'abc'" in err  # schema
    assert "did you mean 'train'" in err  # unknown key
    assert "quant.bits=4 needs an adapter" in err  # cross-field, although a field was invalid
    assert "nope.jsonl' not found" in err  # files, checked on a stand-in config


def test_validate_runs_the_mask_check_on_a_sample(recipe_dict, tmp_path, capsys):
    # The tiny model's char tokenizer has no <|eot_id|>: the llama3 template would never train a stop token.
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": convo}] * 3)
    data = {**recipe_dict, "data": {"path": str(path), "format": "messages", "template": "llama3"}}
    assert main(["validate", write_recipe(tmp_path, data)]) == 2
    err = capsys.readouterr().err
    assert "mask check on the first 3 records: end_untrained: 3 examples" in err, err
    assert main(["validate", write_recipe(tmp_path, data), "data.template=chatml"]) == 0


def test_data_command_marks_trained_tokens_and_preprocess_fills_the_cache(recipe_dict, tmp_path, capsys):
    rows = [{"prompt": "Q:", "completion": "4"}, {"prompt": "Q:", "completion": "42"}]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    data = {**recipe_dict, "data": {"path": str(path), "format": "completion", "cache_dir": str(tmp_path / "cache")}}
    recipe = write_recipe(tmp_path, data)
    assert main(["data", recipe, "--examples", "2"]) == 0
    out = capsys.readouterr().out
    assert "train: 2 examples, 11 tokens (45.5% trained), 0 truncated, 0 dropped" in out
    assert "--- 0: 5 tokens, 2 trained\n<s>Q:[[4</s>]]" in out
    assert "--- 1: 6 tokens, 3 trained\n<s>Q:[[42</s>]]" in out
    assert "tokenized data built" in out
    assert main(["preprocess", recipe]) == 0
    assert "already in the cache" in capsys.readouterr().out


def test_data_command_works_on_a_finished_run(recipe_dict, tmp_path, capsys):
    # `finetune data` reads; an existing output_dir (a run already trained) must not block it.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "recipe.yaml").write_text("x: 1\n")
    recipe = write_recipe(tmp_path, recipe_dict)
    assert main(["validate", recipe]) == 2
    assert main(["data", recipe, "--examples", "1"]) == 0
    assert "train: 64 examples" in capsys.readouterr().out


def test_slurm_example_is_valid_bash_and_uses_real_flags():
    # The sbatch script cannot run here (no Slurm), but it must parse, and every flag it passes
    # to `finetune run` must exist: a renamed flag would otherwise break users' jobs silently.
    import re
    import subprocess
    from pathlib import Path

    from finetune.cli.commands import build_parser

    script = Path(__file__).resolve().parents[1] / "examples" / "slurm" / "finetune.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    call = text[text.index("exec finetune run") : text.index("resume=auto &")]
    flags = set(re.findall(r"(--[a-z-]+)", call))
    assert flags == {"--no-progress", "--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--max-restarts"}
    run = build_parser()._subparsers._group_actions[0].choices["run"]
    known = {s for action in run._actions for s in action.option_strings}
    assert flags <= known


def test_elastic_launch_uses_c10d_and_a_fresh_store_per_restart_round(monkeypatch):
    # A restarted round that reuses the first round's TCPStore reads the dead rank's old
    # address and its gloo mesh cannot connect (pytorch#135712); every round must host its own.
    from finetune.cli.commands import build_parser
    from finetune.parallel.launch import launch_command, launch_env

    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    parser = build_parser()
    elastic = parser.parse_args(["run", "demo-cpu", "--nproc", "2", "--max-restarts", "1", "--master-port", "29700"])
    cmd = launch_command(elastic)
    assert cmd[cmd.index("--max_restarts") + 1] == "1"
    assert cmd[cmd.index("--rdzv_backend") + 1] == "c10d"
    assert cmd[cmd.index("--rdzv_endpoint") + 1] == "127.0.0.1:29700"
    assert launch_env(elastic)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    plain = parser.parse_args(["run", "demo-cpu", "--nproc", "2"])
    assert "--rdzv_backend" not in launch_command(plain)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in launch_env(plain)


def test_nnodes_min_max_launches_an_elastic_job_that_restarts_on_the_nodes_left(capsys, monkeypatch):
    from finetune.cli.commands import build_parser
    from finetune.parallel.launch import ELASTIC_WORLD, launch_command, launch_env

    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    parser = build_parser()
    elastic = parser.parse_args(["run", "demo-cpu", "--nnodes", "1:2", "--node-rank", "1", "--master-port", "29701"])
    cmd = launch_command(elastic)
    assert cmd[cmd.index("--nnodes") + 1] == "1:2"
    assert cmd[cmd.index("--max_restarts") + 1] == "3"  # none given: losing a node restarts the workers left
    assert cmd[cmd.index("--rdzv_backend") + 1] == "c10d" and "--node_rank" not in cmd  # ranks in order of arrival
    assert cmd[cmd.index("--rdzv_conf") + 1] == "last_call_timeout=30"  # --elastic-wait's default
    assert launch_env(elastic)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    given = parser.parse_args(["run", "demo-cpu", "--nnodes", "2:4", "--max-restarts", "7"])
    assert launch_command(given)[launch_command(given).index("--max_restarts") + 1] == "7"
    fixed = launch_command(parser.parse_args(["run", "demo-cpu", "--nnodes", "2", "--node-rank", "1"]))
    assert fixed[fixed.index("--nnodes") + 1] == "2" and fixed[fixed.index("--node_rank") + 1] == "1"
    assert launch_env(given)[ELASTIC_WORLD] == "4"  # 1 process on each of at most 4 nodes: the first start's step
    never = launch_command(parser.parse_args(["run", "demo-cpu", "--nnodes", "1:2", "--max-restarts", "0"]))
    assert never[never.index("--max_restarts") + 1] == "0" and "c10d" in never  # as asked; still an elastic rendezvous
    for wrong in ("0", "2:1", "a:b", "1:"):
        with pytest.raises(SystemExit):
            parser.parse_args(["run", "demo-cpu", "--nnodes", wrong])
        assert f"--nnodes: '{wrong}': a node count N >= 1, or MIN:MAX with 1 <= MIN <= MAX" in capsys.readouterr().err
    for wrong in ("2.5", "0", "-1"):
        with pytest.raises(SystemExit):
            parser.parse_args(["run", "demo-cpu", "--nnodes", "1:2", "--elastic-wait", wrong])
        assert f"--elastic-wait: '{wrong}': whole seconds, at least 1" in capsys.readouterr().err


def test_an_elastic_job_is_checked_on_every_node_count_it_may_restart_on(recipe_dict, tmp_path, capsys):
    import yaml

    from finetune.cli.commands import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**recipe_dict, "output_dir": str(tmp_path / "out"), "train": {"batch_size": 2}}))
    # 1 process a node: the step is sized for 3 replicas (6 examples), which 2 replicas cannot cut into micro-batches of 2
    assert main(["run", str(recipe), "--nnodes", "1:3", "--master-port", "29702"]) == 2
    err = capsys.readouterr().err
    said = (
        "--nnodes: the step's 6 examples (train.batch_size 2 x grad_accum 1 x 3 replicas on the most nodes) cannot be "
        "cut into whole micro-batches on 2 replicas: choose train.grad_accum so that every replica count (1, 2, 3)"
    )
    assert said in " ".join(err.split()), err


def test_kubernetes_example_runs_a_command_the_cli_accepts():
    # The manifests cannot run here (no cluster); they must parse, wire the volume to output_dir,
    # restart on the preemption exit code (75), resume, and run a recipe that validates.
    from pathlib import Path

    import yaml

    from finetune.cli.commands import build_parser
    from finetune.config.schema import load_recipe

    folder = Path(__file__).resolve().parents[1] / "examples" / "kubernetes"
    pvc = yaml.safe_load((folder / "pvc.yaml").read_text())
    job = yaml.safe_load((folder / "pytorchjob.yaml").read_text())
    assert (pvc["kind"], job["kind"], job["apiVersion"]) == ("PersistentVolumeClaim", "PyTorchJob", "kubeflow.org/v1")
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["restartPolicy"] == "OnFailure"  # ExitCode would treat 75 (checkpointed, stopped) as permanent
    pod = worker["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "pytorch"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert volumes["runs"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]

    cmd = container["command"]
    assert cmd[:4] == ["torchrun", "-m", "finetune", "run"]
    args, extra = build_parser().parse_known_args(cmd[3:])
    assert args.func.__name__ == "cmd_run" and not [e for e in extra if e.startswith("-")]
    overrides = list(args.overrides) + extra
    assert "resume=auto" in overrides
    cfg = load_recipe(args.recipe, [o for o in overrides if not o.startswith("resume=")])
    assert cfg.output_dir.startswith(mounts["runs"] + "/") and cfg.data.path.startswith(mounts["runs"] + "/")
    gpus = worker["replicas"] * job["spec"]["elasticPolicy"]["nProcPerNode"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == job["spec"]["elasticPolicy"]["nProcPerNode"]
    assert cfg.train.batch_size * cfg.train.grad_accum * gpus == 16  # the recipe's global batch, as the comment says
