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

Plain scalars are typed by YAML 1.2's core rules, not YAML 1.1's (`_PlainDataLoader`): only
true/false are booleans, only decimal digits make an integer (no digit-group underscores, no 0x,
0o or leading-zero octal, no 1:30 sexagesimal), a float needs its dot or exponent ("1e-3" is one),
and dates stay text. What YAML 1.1 reads otherwise ("on", "2_3" as 23, "010" as 8, "1:30" as 90)
is the text as written, which a string key keeps and a number or boolean key refuses; the same
forms under an explicit tag (``!!int 1_000``) are refused here. `dump` quotes every string either
reading would take for something else, so what it writes reads back the same under both.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import yaml

from .errors import ConfigError
from .safe_files import write_file

#: the deepest nesting of lists and mappings accepted (a config nests a few levels)
MAX_DEPTH = 100


class YamlDataError(ConfigError):
    """A YAML text that is not plain data; the message is one line naming its source. A config
    error: a run refuses it as it refuses a bad key."""


#: YAML 1.2 core schema's plain scalars, except that an integer has no leading zero ("010" is text:
#: 8 to YAML 1.1, 10 to YAML 1.2) and a float has its dot or exponent; first characters for each
_CORE_SCALARS = (
    ("tag:yaml.org,2002:bool", r"true|True|TRUE|false|False|FALSE", ["t", "T", "f", "F"]),
    ("tag:yaml.org,2002:null", r"~|null|Null|NULL|", ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:int", r"[-+]?(?:0|[1-9][0-9]*)", list("-+0123456789")),
    (
        "tag:yaml.org,2002:float",
        r"[-+]?(?:[0-9]+\.[0-9]*(?:[eE][-+]?[0-9]+)?|\.[0-9]+(?:[eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+"
        r"|\.(?:inf|Inf|INF))|\.(?:nan|NaN|NAN)",
        list("-+0123456789."),
    ),
)
_CORE = {tag: re.compile(pattern) for tag, pattern, _ in _CORE_SCALARS}


class _PlainDataLoader(yaml.SafeLoader):
    source = "<yaml>"
    depth = 0
    # YAML 1.1's resolvers replaced (`_CORE_SCALARS`), merge keys (<<) kept
    yaml_implicit_resolvers = {"<": list(yaml.SafeLoader.yaml_implicit_resolvers["<"])}

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

    def _core_form(self, node, tag: str, kind: str):
        """Refuses a value under an explicit tag that is no YAML 1.2 core form ("!!int 1_000")."""
        if not _CORE[tag].fullmatch(node.value):
            raise YamlDataError(
                f"{self.source}: line {node.start_mark.line + 1}: {node.value!r} is no {kind} here; write "
                f"{'true or false' if kind == 'boolean' else 'it in plain decimal digits'}"
            )

    def construct_yaml_bool(self, node):
        self._core_form(node, "tag:yaml.org,2002:bool", "boolean")
        return super().construct_yaml_bool(node)

    def construct_yaml_float(self, node):
        if not _CORE["tag:yaml.org,2002:int"].fullmatch(node.value):  # "!!float 1" is 1.0
            self._core_form(node, "tag:yaml.org,2002:float", "float")
        return super().construct_yaml_float(node)

    def construct_yaml_int(self, node):
        self._core_form(node, "tag:yaml.org,2002:int", "integer")
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


for _tag, _pattern, _first in _CORE_SCALARS:
    _PlainDataLoader.add_implicit_resolver(_tag, re.compile(f"^(?:{_pattern})$"), _first)
    _PlainDataLoader.add_constructor(_tag, getattr(_PlainDataLoader, f"construct_yaml_{_tag.rsplit(':', 1)[1]}"))


class _PlainDataDumper(yaml.SafeDumper):
    """SafeDumper quoting also the strings `_PlainDataLoader` reads as something else ("1e-3")."""


for _tag, _pattern, _first in _CORE_SCALARS:
    _PlainDataDumper.add_implicit_resolver(_tag, re.compile(f"^(?:{_pattern})$"), _first)


def dump(data) -> str:
    """`data` as YAML text that both `load` and a YAML 1.1 reader (``yaml.safe_load``) read back as is."""
    return yaml.dump(data, Dumper=_PlainDataDumper, sort_keys=False)


def load(text: str | bytes, source: str, texts: dict | None = None):
    """The plain data in `text` (a str, or bytes that must be UTF-8); `YamlDataError` otherwise.
    `texts`, a dict, receives the text as written of each unquoted scalar value of a top-level
    mapping, by its key (so that a string key can keep "1e-3" or "12" as text: `config.load`)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise YamlDataError(f"{source}: not UTF-8 text (byte {error.start} is {text[error.start]:#04x})") from None
    loader = _PlainDataLoader(text)
    loader.source = source
    try:
        node = loader.get_single_node()
        if texts is not None and isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if isinstance(key_node, yaml.ScalarNode) and isinstance(value_node, yaml.ScalarNode):
                    if value_node.style is None:
                        texts[key_node.value] = value_node.value
        return None if node is None else loader.construct_document(node)
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


def read_mapping(name_or_path: str, texts: dict | None = None) -> dict:
    """The mapping in the YAML file `name_or_path`, or in the packaged config of that name (`texts`:
    see `load`)."""
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
    values = load(text, f"config file {name_or_path!r}", texts) or {}
    if not isinstance(values, dict):
        raise YamlDataError(f"config file {name_or_path!r} must hold a mapping of keys to values")
    return values


def save_yaml(config: dict, path) -> None:
    """A run's config (its keys and values, `TrainConfig.to_dict`) as YAML at `path`, written whole and
    never through a link (`safe_files.write_file`)."""
    write_file(Path(path), dump(config))
