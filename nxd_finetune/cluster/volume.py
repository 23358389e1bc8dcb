"""The shared volume of a cluster job (``--pvc``, mounted at the same path in every pod): the
Neuron compile cache goes there, and every path of the recipe the pods cannot see is named.

The precompile job fills the compile cache and the training job reads it, in other pods: a cache
on a pod's own disk (Neuron's default ``/var/tmp/neuron-compile-cache``) is lost with the pod. So
with a volume, a recipe without ``neuron.compile_cache`` gets ``<mount>/neuron-cache`` (as an
override passed to the pods, so the workers' recipe agrees with the job's environment); a recipe
whose cache lies elsewhere is refused for the precompile job and warned about for training.

The recipe's paths are read as the pods read them: relative paths in the file against the
directory of the recipe's path inside the pods (``recipe_base``), see :func:`pod_recipe_base`.
"""

from __future__ import annotations

import posixpath
import warnings
from collections.abc import Iterator, Sequence

from nxd_finetune.errors import NxdError, NxdWarning
from nxd_finetune.recipe import Recipe, is_uri

CACHE_SUBDIR = "neuron-cache"


def pod_recipe_base(recipe_path: str) -> str | None:
    """The directory the pods resolve the recipe's relative paths against: that of ``recipe_path``
    when it is an absolute path inside the pods; None when it is not (relative to the image's working
    directory, or a ``builtin:`` recipe): then the paths are read as loaded here."""
    if is_uri(recipe_path) or not posixpath.isabs(recipe_path):
        return None
    return posixpath.dirname(posixpath.normpath(recipe_path))


def recipe_paths(recipe: Recipe) -> Iterator[tuple[str, str]]:
    """``(key, path)`` for every file or directory the recipe's run reads or writes (URIs and
    ``builtin:`` names left out; ``checkpoint.dir`` unset lies under ``output.dir``)."""
    m, d, c = recipe.model, recipe.data, recipe.checkpoint
    values: list[tuple[str, str | Sequence[str] | None]] = [
        ("model.path", m.path), ("model.tokenizer", m.tokenizer), ("data.train", d.train), ("data.eval", d.eval),
        ("data.cache_dir", d.cache_dir), ("lora.init_from", recipe.lora.init_from if recipe.lora else None),
        ("output.dir", recipe.output.dir), ("output.registry", recipe.output.registry),
        ("checkpoint.dir", c.dir), ("checkpoint.resume", None if c.resume == "latest" else c.resume),
        ("neuron.compile_cache", recipe.neuron.compile_cache),
    ]
    if d.chat_template and "{{" not in d.chat_template and "{%" not in d.chat_template:
        values.append(("data.chat_template", d.chat_template))
    for key, value in values:
        for path in [value] if isinstance(value, str) else list(value or []):
            if isinstance(path, str) and not is_uri(path):
                yield key, path


def on_volume(path: str, mount_path: str) -> bool:
    """Whether ``path`` (as the pods see it) lies under ``mount_path``."""
    if not posixpath.isabs(path):
        return False  # relative to the image's working directory: a pod's own disk
    mount = posixpath.normpath(mount_path)
    return posixpath.commonpath([posixpath.normpath(path), mount]) == mount


def warn_unseen_paths(recipe: Recipe, pvc: str, mount_path: str, skip: Sequence[str] = ()) -> list[str]:
    """One warning line per recipe path that is not on the volume (each pod would read or write its
    own copy, or find nothing); returns the keys warned about. ``skip``: keys checked elsewhere."""
    warned = []
    for key, path in recipe_paths(recipe):
        if key in skip or on_volume(path, mount_path):
            continue
        warnings.warn(f"{key}={path} is not on the shared volume ({pvc} at {mount_path}): the pods cannot "
                      "share it; put it under the mount or into the image", NxdWarning, stacklevel=2)
        warned.append(key)
    return warned


def cache_on_volume(recipe: Recipe, overrides: Sequence[str], pvc: str, mount_path: str, *,
                    require: bool) -> tuple[Recipe, list[str]]:
    """``(recipe, overrides)`` with the Neuron compile cache on the volume: unset, it becomes
    ``<mount_path>/neuron-cache`` (an override appended, so the pods' recipe says the same). Set
    elsewhere: NxdError when ``require`` (the precompile job, whose graphs would be lost), else one
    warning line."""
    cache = recipe.neuron.compile_cache
    if cache is None:
        cache = posixpath.join(posixpath.normpath(mount_path), CACHE_SUBDIR)
        neuron = recipe.neuron.model_copy(update={"compile_cache": cache})
        return recipe.model_copy(update={"neuron": neuron}), [*overrides, f"neuron.compile_cache={cache}"]
    if not on_volume(cache, mount_path):
        message = (f"neuron.compile_cache={cache} is not on the shared volume ({pvc} at {mount_path}), so the "
                   "training pods cannot read what precompile compiles; set it under the mount or leave it unset")
        if require:
            raise NxdError(message)
        warnings.warn(message, NxdWarning, stacklevel=2)
    return recipe, list(overrides)
