"""The fusion catalog: recipes are data (one TOML file each) naming what they fix, where they apply, how they patch
and which fusion they use. Users add their own with ``--recipes-dir``; a malformed file is rejected with the file, the
field and why.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from optiq.errors import OptiqError
from optiq.patching.kinds import KINDS
from optiq.patching.structure import STRUCTURES
from optiq.traces.op_classes import CLASSES

# How close a recipe's output must stay to the unfused path's, both measured against an fp32 reference.
TOLERANCES = {
    "exact": "bit-identical to the unfused path",
    "exact_order": "same roundings in the same order as HF; differences only from fused multiply-adds",
    "reassociation": "sums in another order (split reductions, one GEMM for several): errors as large as unfused",
    "lossy": "lower precision on purpose (e.g. fp32 matmuls run in bf16); must still pass the end-to-end bound",
}

@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    fusion: str  # import path "module:attribute" of the kernel entry point
    architectures: tuple[str, ...]  # transformers model types, or "*"
    tolerance: str
    roles: tuple[str, ...]
    op_classes: tuple[str, ...]
    aten_ops: tuple[str, ...]
    kernels_saved_per_layer: int
    patch_kind: str
    patch_target: tuple[str, ...]  # module class names, or one function / interface name
    patch_with: str  # import path "module:attribute" of the factory that builds the replacement
    path: str
    patch_names: tuple[str, ...] = ()  # module_forward only: just the instances under these attribute names
    patch_structure: str = ""  # module_forward only: the instances that compute this (optiq.patching.structure)
    excluded: tuple[str, ...] = ()  # model types it is never tried on, though ``architectures`` is "*"

    def applies_to(self, model_type: str) -> bool:
        return ("*" in self.architectures or model_type in self.architectures) and model_type not in self.excluded

    @property
    def target_label(self) -> str:
        """What it patches, as a person reads it: "Linear named o_proj / down_proj"."""
        named = f" named {' / '.join(self.patch_names)}" if self.patch_names else ""
        computing = f" computing {self.patch_structure}" if self.patch_structure else ""
        classes = "any module" if self.patch_target == ("*",) else " / ".join(self.patch_target)
        return f"{classes}{computing}{named}"

    @property
    def claims(self) -> tuple[tuple[str, str], ...]:
        """What the recipe takes over, in its own order; two recipes that share a claim cannot both be applied."""
        return KINDS[self.patch_kind].claims(self)


def builtin_recipes() -> list[Traversable]:
    """The catalog shipped with optiq: the recipe files of the package ``optiq.builtin_recipes``, read through
    importlib.resources alone, so the working directory and other installed distributions never take its place."""
    return sorted((f for f in resources.files("optiq.builtin_recipes").iterdir() if f.name.endswith(".toml")),
                  key=lambda f: f.name)


def _field(path: Path, table: dict, key: str, kind, where: str = ""):
    if key not in table:
        raise OptiqError(f"{path}: recipe field '{where}{key}' is missing")
    value = table[key]
    if kind is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise OptiqError(f"{path}: recipe field '{where}{key}' must be a list of strings")
        return tuple(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise OptiqError(f"{path}: recipe field '{where}{key}' must be a {kind.__name__}, not {value!r}")
    return value


def _import_path(path: Path, value: str, where: str) -> str:
    module, _, attribute = value.partition(":")
    if not module or not attribute or not all(part.isidentifier() for part in [*module.split("."), attribute]):
        raise OptiqError(f"{path}: recipe field '{where}' must be an import path 'package.module:name', not '{value}'")
    return value


def parse_recipe(path: Path | Traversable) -> Recipe:
    """Read and check one recipe file."""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise OptiqError(f"{path}: not valid TOML ({exc})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise OptiqError(f"{path}: cannot read recipe ({exc})") from None
    fixes = _field(path, data, "fixes", dict)
    patch = _field(path, data, "patch", dict)
    tolerance = _field(path, data, "tolerance", str)
    if tolerance not in TOLERANCES:
        raise OptiqError(f"{path}: recipe field 'tolerance' must be one of {', '.join(TOLERANCES)}, not '{tolerance}'")
    op_classes = _field(path, fixes, "op_classes", list, "fixes.")
    unknown = sorted(set(op_classes) - set(CLASSES))
    if unknown:
        raise OptiqError(f"{path}: recipe field 'fixes.op_classes' has unknown classes {unknown}; known: "
                         f"{', '.join(CLASSES)}")
    saved = _field(path, fixes, "kernels_saved_per_layer", int, "fixes.")
    if saved < 0:
        raise OptiqError(f"{path}: recipe field 'fixes.kernels_saved_per_layer' must be >= 0")
    kind = _field(path, patch, "kind", str, "patch.")
    if kind not in KINDS:
        raise OptiqError(f"{path}: recipe field 'patch.kind' must be one of {', '.join(KINDS)}, not '{kind}'")
    target = _field(path, patch, KINDS[kind].target_field, list if KINDS[kind].many_targets else str, "patch.")
    names = _field(path, patch, "names", list, "patch.") if "names" in patch else ()
    if names and not KINDS[kind].narrows_by_name:
        raise OptiqError(f"{path}: recipe field 'patch.names' narrows a module_forward patch only, not '{kind}'")
    structure = _field(path, patch, "structure", str, "patch.") if "structure" in patch else ""
    if structure and (kind != "module_forward" or structure not in STRUCTURES):
        raise OptiqError(f"{path}: recipe field 'patch.structure' must be one of {', '.join(STRUCTURES)} on a "
                         f"module_forward patch, not '{structure}' on '{kind}'")
    # Where it may be tried: every model by default, the gate deciding; a list narrows it, ``exclude`` leaves out.
    architectures = _field(path, data, "architectures", list) if "architectures" in data else ["*"]
    if not architectures:
        raise OptiqError(f"{path}: recipe field 'architectures' is empty (leave it out for every architecture)")
    excluded = _field(path, data, "exclude", list) if "exclude" in data else ()
    return Recipe(
        name=_field(path, data, "name", str), summary=_field(path, data, "summary", str),
        fusion=_import_path(path, _field(path, data, "fusion", str), "fusion"), architectures=architectures,
        tolerance=tolerance, roles=_field(path, fixes, "roles", list, "fixes."), op_classes=op_classes,
        aten_ops=_field(path, fixes, "aten_ops", list, "fixes."), kernels_saved_per_layer=saved, patch_kind=kind,
        patch_target=target if isinstance(target, tuple) else (target,),
        patch_with=_import_path(path, _field(path, patch, "with", str, "patch."), "patch.with"), path=str(path),
        patch_names=names, patch_structure=structure, excluded=tuple(excluded))


def load_catalog(extra_dirs: list[str] | tuple[str, ...] = ()) -> dict[str, Recipe]:
    """The built-in recipes plus those in ``extra_dirs`` (a user's recipe replaces a built-in one of the same name;
    two user files with the same name are refused)."""
    catalog = {recipe.name: recipe for recipe in map(parse_recipe, builtin_recipes())}
    for directory in map(Path, extra_dirs):
        if not directory.is_dir():
            raise OptiqError(f"{directory}: recipes directory not found")
        seen: dict[str, str] = {}
        for path in sorted(directory.glob("*.toml")):
            recipe = parse_recipe(path)
            if recipe.name in seen:
                raise OptiqError(f"{path}: recipe name '{recipe.name}' is also used by {seen[recipe.name]}")
            seen[recipe.name] = str(path)
            catalog[recipe.name] = recipe
    return catalog
