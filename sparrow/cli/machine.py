"""The machine the cost model prices: one option section shared by `sparrow cost`, `calibrate` and `bench --predict`
(a preset or this machine's measured constants, host time per forward pass, byte sizes)."""

from __future__ import annotations

from dataclasses import dataclass

from sparrow.measure.cost_model import Hardware, Pricing, hardware
from sparrow.typed_config import check_finite, option


def whole_bytes(value: float) -> float | int:
    """An integral byte size as an int, so byte and FLOP counts stay exact integers."""
    return int(value) if float(value).is_integer() else value


@dataclass
class MachineSection:
    """The machine the cost model prices (sparrow cost, calibrate and bench): a preset or this machine's measured
    constants, host time per forward pass, and the bytes of a weight and of a cached K/V element."""

    hardware: str = option("h200", "h100, h200, b200, a100, or cpu (needs --peak-flops and --bandwidth)")
    peak_flops: float | None = option(None, "peak dense FLOP/s (overrides the preset)")
    bandwidth: float | None = option(None, "memory bandwidth in bytes/s (overrides the preset)")
    step_overhead: float = option(0.0, "host seconds per forward pass besides its FLOPs and bytes (Python, "
                                       "launches, sampling): 0 on GPUs; on a CPU, bench's measured step time minus "
                                       "the predicted one (docs/cost-model.md)")
    param_bytes: float = option(2, "bytes per weight (4 for float32, as on CPU)")
    kv_bytes: float = option(2, "bytes per cached K/V element (4 for float32)")

    def validate(self) -> None:
        self.spec()
        for name in ("param_bytes", "kv_bytes"):
            check_finite(name, getattr(self, name), 0, 64, low_open=True)

    def spec(self) -> Hardware:
        """The cost model's Hardware (a SparrowError naming a bad value)."""
        return hardware(self.hardware, self.peak_flops, self.bandwidth, self.step_overhead)

    def pricing(self, **settings) -> Pricing:
        """The cost model's Pricing at this machine's byte sizes; `settings`: its other fields (page_size,
        dense_layers, landmark), the cost model's defaults where not given."""
        return Pricing(bytes_per_param=whole_bytes(self.param_bytes), bytes_per_kv=whole_bytes(self.kv_bytes),
                       **settings)
