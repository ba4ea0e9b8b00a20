"""What the GPU script's wheelhouse holds, and a stand-in for the device image (`run.sh`).

    python tools/gpu/wheelhouse.py needs            # name==version of each wheel to carry
    python tools/gpu/wheelhouse.py image-view DIR   # DIR: links to the image's packages only

Run with the interpreter of tandem's venv: the versions carried are the ones its tests pass on.
`needs` walks the requirements of tandem's distributions (markers and extras as the GPU checks
install them) through what this interpreter has installed, and keeps the distributions that
`image-packages.txt` does not list; tandem's own are built by `run.sh`, not listed here.
`image-view` fills DIR with links to the files of the listed distributions that this venv has
(torch, transformers, numpy ...) and of what they require here (the real image is whole: this
venv's huggingface_hub may need a package the image's older one does not), less what `needs`
carries: a throwaway venv that adds DIR to its path has the image's packages and nothing else,
so a wheel missing from the wheelhouse fails the dry run as it would fail on the device.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HERE = Path(__file__).parent
ROOTS = ["tandem-common[fast]", "tandem-weights", "tandem-master[quickstart]", "tandem-buffer",
         "tandem-explorer", "tandem-trainer", "tandem-reward"]


def image_packages() -> set[str]:
    lines = (HERE / "image-packages.txt").read_text().splitlines()
    return {canonicalize_name(n) for n in lines if n.strip() and not n.startswith("#")}


def needs() -> list[str]:
    image, found = image_packages(), {}
    todo = [Requirement(r) for r in ROOTS]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        extras = found.get(name, (None, set()))[1]
        if name in found and set(req.extras) <= extras:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            sys.exit(f"wheelhouse.py: {req.name} is required but not installed in {sys.prefix}")
        extras = extras | set(req.extras)
        found[name] = (dist.version, extras)
        if name in image:
            continue  # the image brings it with its own requirements
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e})
                                         for e in extras | {""}):
                todo.append(sub)
    return sorted(f"{n}=={v}" for n, (v, _) in found.items()
                  if n not in image and not n.startswith("tandem-"))


def image_closure() -> set[str]:
    """The image's distributions that this venv has, with their requirements (no extras)."""
    names, todo = set(), sorted(image_packages())
    while todo:
        name = todo.pop()
        if name in names:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # on the device only
        names.add(name)
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(sub.name))
    return names


def image_view(target: Path) -> int:
    """Link every top-level file or folder of the image's distributions into `target`."""
    carried = {canonicalize_name(n.split("==")[0]) for n in needs()}
    image = image_closure() - carried
    target.mkdir(parents=True, exist_ok=True)
    linked = 0
    for dist in metadata.distributions():
        if canonicalize_name(dist.metadata["Name"]) not in image:
            continue
        tops = {Path(f).parts[0] for f in dist.files or []
                if not str(f).startswith("..") and Path(f).parts}
        for top in tops:
            source = Path(dist.locate_file(top))
            link = target / top
            if source.exists() and not link.exists() and top != "bin":
                link.symlink_to(source)
                linked += 1
    return linked


def main() -> None:
    if sys.argv[1:] == ["needs"]:
        print("\n".join(needs()))
    elif len(sys.argv) == 3 and sys.argv[1] == "image-view":
        print(f"linked {image_view(Path(sys.argv[2]))} entries into {sys.argv[2]}")
    else:
        sys.exit(__doc__.split("\n\n")[1])


if __name__ == "__main__":
    main()
