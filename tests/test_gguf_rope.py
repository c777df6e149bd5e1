"""GGUF export of Llama 3.1-3.3's llama3 rope scaling: llama.cpp's rope_freqs.weight, checked by value and by logits."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import train_tiny_run
from test_gguf import build_tiny_family, quiet, read_back

from finetune.errors import MergeCheckFailed
from finetune.export import gguf_export, gguf_file, gguf_rope
from finetune.export.gguf_export import export_gguf

pytest.importorskip("gguf", reason="the GGUF export needs the gguf package: pip install -e '.[test]' (or '.[gguf]')")


# Llama 3.1's rope scaling on the tiny Llama (head_dim 16: 8 rotary pairs of wavelength 2 pi 10000^(i/8), 6.3 to
# 19869): with an original context of 256, pairs under 256 / 4 keep their angle, those over 256 turn 8x slower,
# pair 3 (wavelength 199) is smoothed between.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
SMOOTH = (256 / (2 * math.pi * 10000 ** (3 / 8)) - 1) / 3
LLAMA3_FACTORS = [1.0, 1.0, 1.0, 1 / ((1 - SMOOTH) / 8 + SMOOTH), 8.0, 8.0, 8.0, 8.0]


@pytest.fixture(scope="module")
def llama3_run(tmp_path_factory, runs_data):
    tmp = tmp_path_factory.mktemp("llama3")
    (tmp / "model").mkdir()
    model_dir = build_tiny_family("llama", tmp / "model", rope_parameters=LLAMA3_ROPE)
    return model_dir, train_tiny_run(tmp / "run", model_dir, runs_data)


def test_llama3_rope_is_written_as_llama_cpp_rope_freqs_and_read_back_equal(llama3_run, tmp_path):
    import gguf

    model_dir, run = llama3_run
    real = json.loads((Path(__file__).parent / "fixtures/configs/llama-3.1-8b/config.json").read_text())
    assert gguf_file.gguf_family(real, "x").arch == "LLAMA"  # 64 factors, 29 of 1, 6 smoothed from 1.21 to 5.26, 29 of 8
    assert torch.allclose(gguf_file.rope_freqs(real), gguf_rope.transformers_factors(real), rtol=1e-6)
    config = json.loads((model_dir / "config.json").read_text())
    # transformers' own llama3 rope (default inv_freq / scaled inv_freq) gives the hand-worked factors
    assert torch.allclose(gguf_rope.transformers_factors(config), torch.tensor(LLAMA3_FACTORS), rtol=1e-6)
    result = export_gguf(run.path, tmp_path / "gguf", gguf_type="f32", say=quiet)
    check = result.metadata["verification"]
    assert check["passed"] and check["max_abs_diff"] < 1e-4 and check["adapter_effect"] > 1e-2, check
    rope = check["rope"]
    assert rope["passed"] and rope["applied_to_reader"] == 1 and rope["max_abs_diff"] < 1e-6
    assert rope["rope_scaling_metadata"] == []  # as llama.cpp's converter: no rope.scaling.* besides the tensor
    path = tmp_path / "gguf" / "model-f32.gguf"
    reader = gguf.GGUFReader(str(path))
    first = reader.tensors[0]  # llama.cpp's converter writes its generated tensors first
    assert first.name == "rope_freqs.weight" and first.tensor_type.name == "F32"
    assert np.allclose(np.array(first.data), LLAMA3_FACTORS, rtol=1e-6)
    assert [float(reader.fields[f"llama.rope.{k}"].parts[-1][0]) for k in ("freq_base", "dimension_count")] == [1e4, 16]
    # The value check is failing-able: against the config without its scaling, the same file fails
    default = {**config, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert not gguf_rope.rope_check(path, default)["passed"]
    # transformers' loader alone reads llama3 back as default rope: its logits are off, which the check's
    # rope_freqs applied to the reader fixes
    assert float((read_back(tmp_path / "gguf", "model-f32.gguf", run.ids) - run.logits).abs().max()) > 0.1


@pytest.mark.parametrize("damage", ["converter_8192", "left_out", "reader_without_rope"])
def test_a_wrong_or_missing_rope_freqs_fails_the_check(llama3_run, tmp_path, monkeypatch, damage):
    _, run = llama3_run
    factors = gguf_file.rope_freqs
    if damage == "converter_8192":  # llama.cpp's converter reads original_max_position_embeddings at the top level
        monkeypatch.setattr(
            gguf_file,
            "rope_freqs",
            lambda c: factors({**c, "rope_parameters": {**c["rope_parameters"], "original_max_position_embeddings": 8192}}),
        )
    elif damage == "left_out":
        monkeypatch.setattr(gguf_file, "rope_freqs", lambda c: None)
    else:  # the file is right; the reader does not apply its rope_freqs: the logits alone must tell
        monkeypatch.setattr(gguf_export, "apply_file_rope", lambda model, f: 0)
    out = tmp_path / "gguf"
    with pytest.raises(MergeCheckFailed) as err:
        export_gguf(run.path, out, gguf_type="f32", say=quiet)
    assert f"rope scaling equal: {damage == 'reader_without_rope'}" in str(err.value)
    diff = float(str(err.value).split("max |logit diff| ")[1].split(",")[0])
    assert diff > 0.05, diff  # the logits check fails too, by far more than f32's tolerance (4e-4)
    assert not out.exists()
