"""The compile report: what each kernel costs (``cost``), how fast it could run on a GPU
(``roofline``) and one self-contained HTML page that shows it all (``html``)."""

from sextant.report.cost import LaunchCost, launch_cost, program_costs
from sextant.report.roofline import GPUS, Estimate, GpuSpec, estimate, gpu_spec, kernel_totals, time_by_bound

__all__ = [
    "GPUS",
    "Estimate",
    "GpuSpec",
    "LaunchCost",
    "estimate",
    "gpu_spec",
    "kernel_totals",
    "launch_cost",
    "program_costs",
    "time_by_bound",
]
