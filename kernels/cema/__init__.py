"""CEMA: the complex exponential moving average of Megalodon (SPEC §2)."""

from kernels.cema.reference import cema, cema_coefficients, cema_kernel, cema_step

__all__ = ["cema", "cema_coefficients", "cema_kernel", "cema_step"]
