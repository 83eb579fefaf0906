"""The fusion catalog: recipes are data (one TOML file each) naming what they fix, where they apply, how they patch
and which fusion they use. Users add their own with ``--recipes-dir``; a malformed file is rejected with the file, the
field and why.

The loader is strict, since a recipe it half understood would be gated and measured as something it is not: a key
it does not know is refused (with the known key it is closest to: ``tolerence`` is not ``tolerance`` left at a
default), and so is a name ``--recipes`` could not ask for ("", "a,b", "auto", spaces, brackets). A recipe name is
taken once across all directories; a user recipe takes a built-in's place only when it says so, with ``replaces =
"<built-in name>"`` (it may keep that name or take another), never by sharing a name by accident. Only regular files
are read, at most ``MAX_RECIPE_FILES`` of a directory and ``MAX_RECIPE_BYTES`` of a file: a FIFO or device named
``*.toml`` is refused without being opened, and a file nested too deep for the TOML parser is one line, not a
RecursionError.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
import tomllib
import unicodedata
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

# What ``--recipes`` can name: comma-separated, with "auto" for the proposals, so neither a comma nor "auto".
RECIPE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
RESERVED_NAMES = {"auto"}
MAX_RECIPE_BYTES = 1 << 20  # a recipe is a page of TOML; the built-ins are about 1 KB
MAX_RECIPE_FILES = 1000  # in one directory: a catalog is a few dozen, and each file is read and checked
# Every key a recipe file may hold, per table: [patch] takes the target field of any kind (which one is checked with
# the kind).
KNOWN_KEYS = {
    "": {"name", "summary", "fusion", "tolerance", "architectures", "exclude", "replaces", "fixes", "patch"},
    "fixes.": {"roles", "op_classes", "aten_ops", "kernels_saved_per_layer"},
    "patch.": {"kind", "with", "names", "structure", *(kind.target_field for kind in KINDS.values())},
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
    replaces: str = ""  # a user recipe only: the built-in recipe it takes the place of

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
        for item in value:
            _one_line(path, item, where + key)
        return tuple(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise OptiqError(f"{path}: recipe field '{where}{key}' must be a {kind.__name__}, not {_shown(value)}")
    if kind is str:
        _one_line(path, value, where + key)
    return value


def _shown(value, limit: int = 40) -> str:
    """A value of a recipe file as an error message quotes it: its repr, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _one_line(path: Path, text: str, key: str) -> None:
    """Refuse a string holding control characters (newlines, terminal escapes): every recipe string is shown on one
    line of a table or a terminal."""
    if any(unicodedata.category(c) == "Cc" for c in text):
        raise OptiqError(f"{path}: recipe field '{key}' holds control characters ({_shown(text)})")


def _no_unknown_keys(path: Path, table: dict, where: str) -> None:
    for key in table:
        if key not in KNOWN_KEYS[where]:
            close = difflib.get_close_matches(str(key), KNOWN_KEYS[where], n=1)
            hint = (f"; did you mean '{where}{close[0]}'?" if close else
                    f"; known: {', '.join(sorted(KNOWN_KEYS[where]))}")
            raise OptiqError(f"{path}: unknown recipe field '{where}{_shown(key)[1:-1]}'{hint}")


def _recipe_name(path: Path, value: str, key: str) -> str:
    if not RECIPE_NAME.fullmatch(value) or value in RESERVED_NAMES:
        raise OptiqError(f"{path}: recipe field '{key}' must be 1-64 letters, digits, '_' or '-' (starting with a "
                         f"letter or digit) and not 'auto', so that --recipes can name it; not {_shown(value)}")
    return value


def _read_text(path: Path | Traversable) -> str:
    """A recipe file's text: a regular file of at most MAX_RECIPE_BYTES, in UTF-8. Its kind is checked before it is
    opened, as opening a FIFO for reading waits for a writer that may never come."""
    try:
        if isinstance(path, Path):
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise OptiqError(f"{path}: not a regular file (a FIFO, device or directory named *.toml); a recipe "
                                 "must be one")
            with open(path, "rb") as file:
                data = file.read(MAX_RECIPE_BYTES + 1)
        else:
            data = path.read_bytes()
    except OSError as exc:
        raise OptiqError(f"{path}: cannot read recipe ({exc.strerror or exc})") from None
    if len(data) > MAX_RECIPE_BYTES:
        raise OptiqError(f"{path}: larger than {MAX_RECIPE_BYTES >> 10} KiB; a recipe is a page of TOML")
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise OptiqError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def _import_path(path: Path, value: str, where: str) -> str:
    module, _, attribute = value.partition(":")
    if not module or not attribute or not all(part.isidentifier() for part in [*module.split("."), attribute]):
        raise OptiqError(f"{path}: recipe field '{where}' must be an import path 'package.module:name', not "
                         f"{_shown(value)}")
    return value


def parse_recipe(path: Path | Traversable) -> Recipe:
    """Read and check one recipe file."""
    text = _read_text(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise OptiqError(f"{path}: not valid TOML ({exc})") from None
    except RecursionError:
        raise OptiqError(f"{path}: not valid TOML (arrays or tables nested too deeply)") from None
    _no_unknown_keys(path, data, "")
    fixes = _field(path, data, "fixes", dict)
    patch = _field(path, data, "patch", dict)
    _no_unknown_keys(path, fixes, "fixes.")
    _no_unknown_keys(path, patch, "patch.")
    tolerance = _field(path, data, "tolerance", str)
    if tolerance not in TOLERANCES:
        raise OptiqError(f"{path}: recipe field 'tolerance' must be one of {', '.join(TOLERANCES)}, not "
                         f"{_shown(tolerance)}")
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
        raise OptiqError(f"{path}: recipe field 'patch.kind' must be one of {', '.join(KINDS)}, not {_shown(kind)}")
    target = _field(path, patch, KINDS[kind].target_field, list if KINDS[kind].many_targets else str, "patch.")
    names = _field(path, patch, "names", list, "patch.") if "names" in patch else ()
    if names and not KINDS[kind].narrows_by_name:
        raise OptiqError(f"{path}: recipe field 'patch.names' narrows a module_forward patch only, not '{kind}'")
    structure = _field(path, patch, "structure", str, "patch.") if "structure" in patch else ""
    if structure and (kind != "module_forward" or structure not in STRUCTURES):
        raise OptiqError(f"{path}: recipe field 'patch.structure' must be one of {', '.join(STRUCTURES)} on a "
                         f"module_forward patch, not {_shown(structure)} on '{kind}'")
    others = sorted({k.target_field for k in KINDS.values()} - {KINDS[kind].target_field} & set(patch))
    if others:
        raise OptiqError(f"{path}: recipe field 'patch.{others[0]}' names another kind's target; a '{kind}' patch "
                         f"takes 'patch.{KINDS[kind].target_field}'")
    # Where it may be tried: every model by default, the gate deciding; a list narrows it, ``exclude`` leaves out.
    architectures = _field(path, data, "architectures", list) if "architectures" in data else ["*"]
    if not architectures:
        raise OptiqError(f"{path}: recipe field 'architectures' is empty (leave it out for every architecture)")
    excluded = _field(path, data, "exclude", list) if "exclude" in data else ()
    replaces = _recipe_name(path, _field(path, data, "replaces", str), "replaces") if "replaces" in data else ""
    return Recipe(
        name=_recipe_name(path, _field(path, data, "name", str), "name"), summary=_field(path, data, "summary", str),
        fusion=_import_path(path, _field(path, data, "fusion", str), "fusion"), architectures=architectures,
        tolerance=tolerance, roles=_field(path, fixes, "roles", list, "fixes."), op_classes=op_classes,
        aten_ops=_field(path, fixes, "aten_ops", list, "fixes."), kernels_saved_per_layer=saved, patch_kind=kind,
        patch_target=target if isinstance(target, tuple) else (target,),
        patch_with=_import_path(path, _field(path, patch, "with", str, "patch."), "patch.with"), path=str(path),
        patch_names=names, patch_structure=structure, excluded=tuple(excluded), replaces=replaces)


def load_catalog(extra_dirs: list[str] | tuple[str, ...] = ()) -> dict[str, Recipe]:
    """The built-in recipes plus those in ``extra_dirs``. A name is refused the second time it is seen, in any
    directory, and a user recipe named like a built-in one unless it ``replaces`` it (module docstring); a recipe
    that replaces a built-in one takes its place in the catalog's order."""
    builtin = {recipe.name: recipe for recipe in map(parse_recipe, builtin_recipes())}
    catalog = dict(builtin)
    seen: dict[str, str] = {}  # every user recipe's name, and the built-ins' a user recipe replaced -> its file
    for directory in dict.fromkeys(map(Path, extra_dirs)):  # the same directory twice is read once
        if not directory.is_dir():
            raise OptiqError(f"{directory}: recipes directory not found")
        paths = sorted(directory.glob("*.toml"))
        if len(paths) > MAX_RECIPE_FILES:
            raise OptiqError(f"{directory}: {len(paths)} recipe files; a recipes directory holds at most "
                             f"{MAX_RECIPE_FILES}")
        for path in paths:
            recipe = parse_recipe(path)
            for name in dict.fromkeys((recipe.name, recipe.replaces) if recipe.replaces else (recipe.name,)):
                if name in seen:
                    raise OptiqError(f"{path}: recipe name '{name}' is also "
                                     f"{'replaced' if name in builtin else 'used'} by {seen[name]}")
                seen[name] = str(path)
            if recipe.replaces and recipe.replaces not in builtin:
                raise OptiqError(f"{path}: recipe field 'replaces' must name a built-in recipe ({', '.join(builtin)}), "
                                 f"not '{recipe.replaces}'")
            if recipe.name in builtin and recipe.replaces != recipe.name:
                raise OptiqError(f"{path}: recipe name '{recipe.name}' is a built-in recipe's; choose another name, "
                                 f'or add replaces = "{recipe.name}" to take its place')
            if recipe.replaces:
                catalog = {recipe.name if name == recipe.replaces else name:
                           recipe if name == recipe.replaces else known for name, known in catalog.items()}
            else:
                catalog[recipe.name] = recipe
    return catalog
