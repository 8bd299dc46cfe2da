"""The sections of benchmarks/results/claims.md (``benchmarks/claims.py`` writes and checks the page).

``render`` reads the JSON files of benchmarks/results/ (``text.load``) and joins the sections: the
header (``header``), one module per paper (``lrkv``, ``kvm``, ``latentllm``), the calibration
of a conversion (``calibration``), KVM on a pretrained model (``bounded``), the RoPE price of a latent cache (``latent``), how much healing
it needs (``healing``) and the speed measurements (``speed``). The verdict rules are
``rules``; ``results`` holds the views of the two trained-model frontiers.
"""

from __future__ import annotations

from .bounded import bounded_section
from .calibration import calibration_section
from .header import header
from .healing import healing_curve_section
from .kvm import kvm_section
from .latent import latent_section
from .latentllm import latentllm_section
from .lrkv import lrkv_section
from .results import Frontier, Recall
from .speed import speed_section
from .text import load

LATENT_RUNS = ("convert_latent_healed_smollm2.json", "convert_latent_healed_all_smollm2.json", "convert_latent25_healed_smollm2.json", "convert_latent_seed1_smollm2.json", "convert_latent_allocation_smollm2.json",
               "convert_measured_allocation_smollm2.json", "convert_measured_allocation_seed1_smollm2.json", "convert_lrkv_split_smollm2.json",
               "convert_latent25_sensitivity_healed_smollm2.json", "convert_lrkv_decoupled_smollm2.json",
               "convert_lrkv_decoupled_more_smollm2.json", "heal_lrkv_decoupled05_30000_lr3e-5.json")  # the latent section's files beside the one-shot comparison

HEALING_RUNS = ("convert_latent_mix5_smollm2.json", "convert_latent_healed_smollm2.json", "convert_latent25_healed_smollm2.json",
                "heal_curve_latent05_15000.json", "heal_curve_latent05_30000.json", "heal_curve_latent05_60000.json",
                "heal_curve_latent025_30000.json", "heal_curve_latent025_60000.json", "heal_curve_latent025_120000.json")
HEALING_LR_RUNS = ("heal_lr_latent025_30000_lr3e-4.json", "heal_lr_latent025_30000_lr1e-3.json", "heal_lr_latent025_30000_lr3e-3.json",
                   "heal_lr_latent05_30000_lr1e-3.json")  # the learning-rate sweep
BOUNDED_DECODE = ("decode_kvm_smollm2_1thread.json", "decode_mla_kvm_smollm2_1thread.json")  # decode_smollm2.py --converted with the bounded conversions
HEALING_FIGURE = "heal_curve_latent_smollm2.png"  # convert_oneshot.py --curve-from HEALING_RUNS


def render() -> str:
    """The whole of claims.md from the committed JSON."""
    recall = Recall(load("recall_frontier.json"))
    frontier = Frontier(load("lm_frontier.json"))
    decode = {name: load(name) for name in ("decode_all_1thread.json", "decode_all_2thread.json", "decode_torch_path_1thread.json", "decode_roofline_1thread.json",
                                          "decode_roofline_bf16_1thread.json")}
    native = {name: load(name) for name in ("decode_native_1thread.json", "decode_native_2thread.json")}
    parts = [
        header(load("compress_calibration_curve.json")),
        lrkv_section(recall, frontier, load("convert_oneshot_smollm2.json")),
        calibration_section({name: load(name) for name in ("convert_oneshot_smollm2.json", "convert_oneshot_mix_smollm2.json")},
                            {name: load(name) for name in ("convert_heldout_plays_smollm2.json", "convert_heldout_mix3_smollm2.json")},
                            {name: load(name) for name in ("convert_latent_smollm2.json", "convert_latent_mix5_smollm2.json")}),
        latent_section(load("convert_latent_smollm2.json"), [load(name) for name in LATENT_RUNS]),
        healing_curve_section([load(name) for name in HEALING_RUNS], HEALING_FIGURE, [load(name) for name in HEALING_LR_RUNS]),
        kvm_section(recall, frontier, load("needles_mha_4000steps.json"), load("needles_recipe_probes.json"), load("niah_kvm.json"), decode,
                    load("kvm_speed.json"), load("kvm_speed_backward.json")),
        bounded_section(load("convert_kvm_smollm2.json"), load("niah_kvm_smollm2.json"), {name: load(name) for name in BOUNDED_DECODE}),
        latentllm_section(load("compress_sweep_smollm2.json"), load("compress_prefill_latentllm03.json")),
        speed_section(decode, native, load("decode_smollm2_1thread.json")),
    ]
    return "\n\n".join(parts) + "\n"
