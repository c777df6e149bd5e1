"""precision=auto and explicit precisions, decided from the device's capabilities."""

from __future__ import annotations

import pytest

from finetune.errors import HardwareError
from finetune.hardware import Device, resolve_precision

AMPERE = Device("cuda", "RTX 3090", supports_bf16=True, supports_fp16=True)
TURING = Device("cuda", "T4", supports_bf16=False, supports_fp16=True)
PLAIN_CPU = Device("cpu", "cpu", supports_bf16=False, supports_fp16=False)
BF16_CPU = Device("cpu", "cpu", supports_bf16=True, supports_fp16=False)


@pytest.mark.parametrize("device, expected", [(AMPERE, "bf16"), (TURING, "fp16"), (PLAIN_CPU, "fp32"), (BF16_CPU, "bf16")])
def test_auto(device, expected):
    assert resolve_precision("auto", device) == expected


def test_explicit_choices():
    assert resolve_precision("fp32", TURING) == "fp32"
    assert resolve_precision("fp16", TURING) == "fp16"
    with pytest.raises(HardwareError) as err:
        resolve_precision("bf16", TURING)
    assert "T4 has no bf16 support" in str(err.value)
    with pytest.raises(HardwareError) as err:
        resolve_precision("bf16", PLAIN_CPU)
    assert "no native bf16" in str(err.value) and "precision=auto" in str(err.value)
    with pytest.raises(HardwareError) as err:
        resolve_precision("fp16", PLAIN_CPU)
    assert "fp16" in str(err.value)
