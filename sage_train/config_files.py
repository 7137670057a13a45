"""Config files and values, read as plain YAML data: the config files (a path, or the name of a
packaged config), ``--key=value`` overrides and DeepSpeed files a user hands sage-train, and the
run configs sage-eval and a resumed run read back; and the run config written into a run directory
and its checkpoints (`save_yaml`). The config itself is `sage_train.config.TrainConfig`.

On top of ``yaml.safe_load`` (no Python objects), refused with one line naming the source:
text that is not UTF-8; a syntax error (its line and column); a tag beyond YAML's plain types
(``!!python/...``); an alias (``*name``: a few hundred bytes of nested aliases expand to
gigabytes once copied, so they are refused before anything is built); a key given twice in
one mapping (YAML itself would silently keep the last value); values nested deeper than
`MAX_DEPTH` (the parser recurses once per level: 10,000 levels exhaust Python's stack); and an
integer of more digits than Python converts (4300).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import yaml

from .config_rules import ConfigError
from .safe_files import write_file

#: the deepest nesting of lists and mappings accepted (a config nests a few levels)
MAX_DEPTH = 100


class YamlDataError(ConfigError):
    """A YAML text that is not plain data; the message is one line naming its source. A config
    error: a run refuses it as it refuses a bad key."""


class _PlainDataLoader(yaml.SafeLoader):
    source = "<yaml>"
    depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if self.check_event(yaml.AliasEvent):
            raise YamlDataError(
                f"{self.source}: line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not "
                f"accepted; write the value out"
            )
        if self.depth >= MAX_DEPTH:
            raise YamlDataError(
                f"{self.source}: line {event.start_mark.line + 1}: nested deeper than {MAX_DEPTH} levels"
            )
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def fetch_flow_collection_start(self, token_class):
        # the scanner's own count of open [ and {: refused here, before it scans ahead for the simple
        # keys each of them may start (a cost quadratic in the nesting, seconds at 1000 levels)
        if self.flow_level >= MAX_DEPTH:
            raise YamlDataError(f"{self.source}: line {self.line + 1}: nested deeper than {MAX_DEPTH} levels")
        super().fetch_flow_collection_start(token_class)

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # Python's limit on int(str): a value no config key takes anyway
            raise YamlDataError(
                f"{self.source}: line {node.start_mark.line + 1}: an integer of {len(node.value)} characters, "
                f"more digits than Python reads"
            ) from None

    def construct_mapping(self, node, deep=False):
        self.flatten_mapping(node)  # merge keys (<<) first, as SafeLoader does
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool, type(None))):
                raise YamlDataError(
                    f"{self.source}: line {key_node.start_mark.line + 1}: a mapping key must be a scalar"
                )
            if key in seen:
                raise YamlDataError(f"{self.source}: line {key_node.start_mark.line + 1}: key {key!r} is given twice")
            seen.add(key)
        return super().construct_mapping(node, deep)


_PlainDataLoader.add_constructor("tag:yaml.org,2002:int", _PlainDataLoader.construct_yaml_int)


def load(text: str | bytes, source: str):
    """The plain data in `text` (a str, or bytes that must be UTF-8); `YamlDataError` otherwise."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise YamlDataError(f"{source}: not UTF-8 text (byte {error.start} is {text[error.start]:#04x})") from None
    loader = _PlainDataLoader(text)
    loader.source = source
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = " ".join(filter(None, (error.context, error.problem)))
        raise YamlDataError(f"{source}: invalid YAML at {where}{problem}") from None
    except yaml.YAMLError as error:
        raise YamlDataError(f"{source}: invalid YAML: {' '.join(str(error).split())}") from None
    finally:
        loader.dispose()


def read(path) -> object:
    """The plain data in the YAML (or JSON) file `path`."""
    try:
        raw = Path(path).read_bytes()
    except OSError as error:
        raise YamlDataError(f"{path}: cannot be read ({error.strerror or error})") from None
    return load(raw, str(path))


def packaged_config_path(name: str):
    """The packaged YAML `name` (with or without .yaml) in sage_train/configs, or None."""
    candidate = resources.files("sage_train") / "configs" / (name if name.endswith(".yaml") else f"{name}.yaml")
    return candidate if candidate.is_file() else None


def packaged_config_names() -> list[str]:
    folder = resources.files("sage_train") / "configs"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def read_mapping(name_or_path: str) -> dict:
    """The mapping in the YAML file `name_or_path`, or in the packaged config of that name."""
    path = Path(name_or_path)
    source = path if path.is_file() else packaged_config_path(name_or_path)
    if source is None:
        raise YamlDataError(
            f"config file {name_or_path!r} not found (a path, or one of the packaged configs {packaged_config_names()})"
        )
    try:
        text = source.read_bytes()
    except OSError as error:
        raise YamlDataError(f"config file {name_or_path!r} cannot be read ({error.strerror or error})") from None
    values = load(text, f"config file {name_or_path!r}") or {}
    if not isinstance(values, dict):
        raise YamlDataError(f"config file {name_or_path!r} must hold a mapping of keys to values")
    return values


def save_yaml(cfg, path) -> None:
    """The config `cfg` (a TrainConfig) as YAML at `path`, written whole and never through a link
    (`safe_files.write_file`)."""
    write_file(Path(path), yaml.safe_dump(cfg.to_dict(), sort_keys=False))
