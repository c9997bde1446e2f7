"""qsa_lab: reproduce, fingerprint and fix the grouped page4 null-block NaN.

Data flow: case -> poison -> plan -> route -> fingerprint -> figure.
"""
__version__ = "0.1.0"

from .case import Case, Geometry, build_case  # noqa: E402
from .poison import apply_poison  # noqa: E402
from .plan import pad_fix, plan_groups  # noqa: E402
from .routes import ROUTES, run_routes  # noqa: E402

__all__ = ["Case", "Geometry", "build_case", "apply_poison", "plan_groups", "pad_fix", "ROUTES",
           "run_routes", "__version__"]
