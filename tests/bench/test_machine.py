"""Machine details and the noise flag: a steady baseline passes, a noisy one or a crowded
machine trips it."""

from __future__ import annotations

import json

from tiered_kv.bench import machine

STEADY = [1.00, 1.01, 0.99, 1.02, 1.00, 0.98, 1.01]


def test_a_steady_baseline_is_not_noisy():
    noise = machine.noise_check(STEADY, [(0.5, 0.5, 0.5)], cpus=2)
    assert noise == machine.Noise(False, ())


def test_a_baseline_that_halves_part_way_is_noisy():
    noisy = [1.0, 1.0, 1.0, 2.1, 2.0, 1.0, 1.0]
    noise = machine.noise_check(noisy)
    assert noise.noisy and any("spread 2.10x" in r for r in noise.reasons)


def test_a_wide_middle_half_is_noisy_even_within_the_spread_limit():
    wide = [1.0, 1.0, 1.3, 1.3, 1.4, 1.4, 1.0, 1.4]  # max / min 1.4 < 1.5; IQR 0.4 of 1.3
    noise = machine.noise_check(wide)
    assert noise.noisy and len(noise.reasons) == 1 and "IQR" in noise.reasons[0]


def test_one_sample_is_not_judged_and_limits_can_be_set():
    assert not machine.noise_check([5.0]).noisy
    assert machine.noise_check(STEADY, max_spread=1.01, max_iqr=1.0).noisy


def test_load_per_core_over_the_limit_is_noisy():
    crowded = machine.noise_check(None, [None, (4.5, 1.0, 1.0)], cpus=2)
    assert crowded.noisy and "load average 4.50 on 2 cores" in crowded.reasons[0]
    assert not machine.noise_check(None, [(1.9, 9.0, 9.0)], cpus=2).noisy  # 1-minute only


def test_machine_info_is_json_ready_and_the_lines_name_it():
    info = machine.machine_info("cpu")
    for key in ("python", "cpu_model", "cpu_count", "usable_cpus", "memory_total_gib",
                "load_average", "versions", "device"):  # fmt: skip
        assert key in info, key
    assert set(info["versions"]) == {"torch", "triton", "numpy", "lmdb"}
    json.dumps(info)
    lines = machine.condition_lines(info)
    assert lines[0].startswith("python ") and any(x.startswith("load average") for x in lines)
    assert any(x.startswith("device cpu") for x in lines)


def test_load_watch_records_before_and_after():
    watch = machine.LoadWatch()
    loads = watch.finish()
    assert set(loads) == {"load_before", "load_after"}
    assert loads["load_before"] is None or len(loads["load_before"]) == 3
