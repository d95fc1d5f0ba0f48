"""Preprocessing: how a source's raw columns become the network's input, fitted on the training
rows and stored with the model, so that every prediction path applies exactly the same steps.

A feature column is one of three kinds:

- **numeric** (smallint, integer, bigint, real, double precision, numeric): read as float32, a
  NULL (or NaN) as NaN; one input value.
- **categorical** (text, varchar, char, enum, boolean, and domains over them): read as text, a
  NULL as None. ``one_hot`` (default) gives one input per category kept: the
  ``max_categories`` most frequent in the training rows (ties by value), plus an "other" input
  when the training rows hold more, which every rarer value maps to. ``ordinal`` gives one input,
  the category's 1-based position in the given order (``{"ordinal": ["low", "mid", "high"]}``)
  or in sorted order of the values, 0 for other.
- **array**: one numeric array column holding all of a row's values (an image); no missing
  values are imputed in it.

Missing values (``impute``, per column or for all): ``error`` (default; the call names the column
and the count), ``mean``, ``median`` (numeric only: as the call-wide ``impute``, categorical
columns take ``mode`` instead; named for a categorical column in ``preprocess``, refused), ``mode``
(the most frequent value; ties: the smallest), or ``{"constant": value}`` (a number for numeric,
a string for categorical columns).
A category never seen in training (``unseen``): ``other`` (default) treats it as the "other"
category — the other input when the model has one, else no input set (one-hot) or 0 (ordinal) —
and ``error`` refuses the row, naming the column and the value. A column that kept only its
``max_categories`` most frequent values has an "other" category already, which every value
beyond those is, seen in training or not: ``error`` refuses nothing there.

Scaling is the last step, fitted on the training rows by the training job (``x_mean`` /
``x_std`` with the weights, :mod:`.model`): each input column has a mode from :meth:`Preprocessor.scale_modes`,
``standardize`` (mean 0, standard deviation 1), ``minmax`` (0 to 1) or ``none``; one-hot inputs
are never scaled.

A model stored without a preprocessing record (trained before it existed) reads every feature as
numeric and refuses NULLs: :meth:`Preprocessor.numeric_only`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import InvalidArgument
from . import side_by_side
from .checks import check_keys, shown

IMPUTE = ("error", "mean", "median", "mode")
ENCODINGS = ("one_hot", "ordinal")
SCALES = ("standardize", "minmax", "none")
UNSEEN = ("other", "error")
KINDS = ("numeric", "categorical", "array")
#: Keys of one column's entry in options.preprocess.
COLUMN_KEYS = ("impute", "encode", "scale")
#: Longest category value kept, characters; longer values are refused by name.
MAX_CATEGORY_CHARS = 1000


@dataclass(frozen=True)
class Categories:
    """A categorical column as read: ``codes`` (N,) int32, each row's index into ``values`` (its
    distinct texts, in order of first appearance), -1 for a NULL. Decoding a million rows into this
    form costs one dictionary lookup a row instead of a string object a row, and every later
    step (counting, the mode, the lookup of a category's input) works on the codes."""

    codes: np.ndarray
    values: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, rows) -> "Categories":
        """The rows ``rows`` (an index array or a slice), with the same values."""
        return Categories(self.codes[rows], self.values)

    @classmethod
    def of(cls, texts) -> "Categories":
        """From a sequence of str or None (an object array)."""
        lookup: dict[str, int] = {}
        codes = np.fromiter((-1 if v is None else lookup.setdefault(v, len(lookup)) for v in texts), dtype=np.int32,
                            count=len(texts))
        return cls(codes, tuple(lookup))

    def counts(self) -> np.ndarray:
        """(len(values),) int64: rows holding each value."""
        return np.bincount(self.codes[self.codes >= 0], minlength=len(self.values))


def as_categories(values) -> Categories:
    """``values`` as :class:`Categories` (given so, or as str / None in a sequence)."""
    return values if isinstance(values, Categories) else Categories.of(list(values))


def _check_impute(value, where: str) -> None:
    if value in IMPUTE:
        return
    if isinstance(value, dict) and set(value) == {"constant"}:
        constant = value["constant"]
        if isinstance(constant, str) or (isinstance(constant, (int, float)) and not isinstance(constant, bool)
                                          and math.isfinite(constant)):
            return
    raise InvalidArgument(f"{where} must be one of {', '.join(IMPUTE)} or {{\"constant\": value}} (a finite number "
                          f"or a string), got {shown(value)}")


def _check_encode(value, where: str) -> None:
    if value in ENCODINGS:
        return
    if (isinstance(value, dict) and set(value) == {"ordinal"} and isinstance(value["ordinal"], list)
            and value["ordinal"] and all(isinstance(v, str) for v in value["ordinal"])
            and len(set(value["ordinal"])) == len(value["ordinal"])):
        return
    raise InvalidArgument(f"{where} must be one of {', '.join(ENCODINGS)} or {{\"ordinal\": [distinct strings, in "
                          f"order]}}, got {shown(value)}")


def _check_scale(value, where: str) -> None:
    if value not in SCALES:
        raise InvalidArgument(f"{where} must be one of {', '.join(SCALES)}, got {shown(value)}")


def check_options(opts) -> None:
    """Validate the preprocessing options of :class:`.model.TrainOptions` ``opts``: ``impute``,
    ``encode``, ``scale``, ``unseen`` and each column's entry of ``preprocess``. Raises
    InvalidArgument naming the key and the value."""
    _check_impute(opts.impute, "options.impute")
    _check_encode(opts.encode, "options.encode")
    if opts.scale is not None:
        _check_scale(opts.scale, "options.scale")
    if opts.unseen not in UNSEEN:
        raise InvalidArgument(f"options.unseen must be one of {', '.join(UNSEEN)}, got {shown(opts.unseen)}")
    for column, rule in (opts.preprocess or {}).items():
        where = f'options.preprocess."{column}"'
        if not isinstance(rule, dict):
            raise InvalidArgument(f'{where} must be an object such as {{"impute": "mean", "scale": "minmax"}}, '
                                  f"got {shown(rule)}")
        check_keys(rule, COLUMN_KEYS, where)
        if "impute" in rule:
            _check_impute(rule["impute"], f"{where}.impute")
        if "encode" in rule:
            _check_encode(rule["encode"], f"{where}.encode")
        if "scale" in rule:
            _check_scale(rule["scale"], f"{where}.scale")


def imputes(opts, column: str) -> bool:
    """Whether the options fill a missing value of ``column`` (rather than refuse it)."""
    return _rule(opts, column)["impute"] != "error"


def _rule(opts, column: str) -> dict:
    """The effective impute / encode / scale of ``column`` under ``opts``."""
    default_scale = opts.scale or ("standardize" if opts.standardize else "none")
    rule = {"impute": opts.impute, "encode": opts.encode, "scale": default_scale}
    rule.update((opts.preprocess or {}).get(column, {}))
    return rule


@dataclass
class Column:
    """One fitted feature column. ``fill``: the value a missing one becomes (None: refused);
    ``categories``: the categories kept, in input order (categorical only); ``other``: whether a
    one-hot column has an "other" input; ``width``: inputs (an array column: values per row)."""

    name: str
    kind: str
    impute: str = "error"
    fill: float | str | None = None
    encode: str | None = None
    categories: list[str] = field(default_factory=list)
    other: bool = False
    scale: str = "standardize"
    width: int = 1

    def input_names(self) -> list[str]:
        if self.kind == "categorical" and self.encode == "one_hot":
            return [f"{self.name}={c}" for c in self.categories] + ([f"{self.name}=(other)"] if self.other else [])
        if self.kind == "array":
            return [f"{self.name}[{i + 1}]" for i in range(self.width)]
        return [self.name]


def _mode(values: np.ndarray):
    """The most frequent of ``values`` (ties: the smallest), or None for none."""
    if len(values) == 0:
        return None
    uniq, counts = np.unique(values, return_counts=True)
    return uniq[int(np.argmax(counts))]          # np.unique sorts, argmax takes the first maximum


def _fit_numeric(name: str, values, rule: dict) -> Column:
    """``values()``: the column's training rows, (N,) float32, asked for only to impute from."""
    impute, fill = rule["impute"], None
    if isinstance(impute, dict):
        if isinstance(impute["constant"], str):
            raise InvalidArgument(f'column "{name}" is numeric; its impute constant must be a number, got '
                                  f"{shown(impute['constant'])}")
        impute, fill = "constant", float(impute["constant"])
    elif impute != "error":
        values = values()
        present = values[~np.isnan(values)]
        if len(present) == 0:
            raise InvalidArgument(f'column "{name}" has no value in the training rows to impute its {impute} from; '
                                  'give it {"constant": value} or leave the column out')
        fill = float({"mean": np.mean, "median": np.median, "mode": _mode}[impute](present.astype(np.float64)))
    return Column(name, "numeric", impute, fill, scale=rule["scale"])


def _fit_categorical(name: str, values: Categories, rule: dict, max_categories: int) -> Column:
    counts = values.counts()
    seen = np.flatnonzero(counts)                  # the values the training rows hold
    impute, fill = rule["impute"], None
    if isinstance(impute, dict):
        if not isinstance(impute["constant"], str):
            raise InvalidArgument(f'column "{name}" is categorical; its impute constant must be a string, got '
                                  f"{shown(impute['constant'])}")
        impute, fill = "constant", impute["constant"]
    elif impute in ("mean", "median"):
        raise InvalidArgument(f'column "{name}" is categorical: impute {impute} needs numbers; use "mode" or '
                              '{"constant": "..."}')
    elif impute == "mode":
        if not len(seen):
            raise InvalidArgument(f'column "{name}" has no value in the training rows to impute its mode from; '
                                  'give it {"constant": "..."} or leave the column out')
        fill = min(values.values[i] for i in seen if counts[i] == counts.max())        # ties: the smallest
    too_long = next((values.values[i] for i in seen if len(values.values[i]) > MAX_CATEGORY_CHARS), None)
    if too_long is not None:
        raise InvalidArgument(f'column "{name}" holds a value of {len(too_long):,} characters; a category may have at '
                              f"most {MAX_CATEGORY_CHARS:,}: leave such free text out of the features")
    encode = rule["encode"]
    if isinstance(encode, dict):                     # ordinal in the order given: it names every value
        missing = sorted({values.values[i] for i in seen} - set(encode["ordinal"]))
        if missing:
            raise InvalidArgument(f'column "{name}" holds {", ".join(map(shown, missing[:5]))}'
                                  f'{" and more" if len(missing) > 5 else ""} in the training rows, which the ordinal '
                                  f'order of options.preprocess."{name}".encode does not name; add '
                                  f'{"them" if len(missing) > 1 else "it"} to the list in its place')
        return Column(name, "categorical", impute, fill, "ordinal", list(encode["ordinal"]), scale=rule["scale"])
    # Categories are counted on the values as the model reads them: a filled NULL is its fill
    # (so a constant such as "missing" becomes a category of its own, not an unseen value).
    read = {values.values[i]: int(counts[i]) for i in seen}
    n_missing = int((values.codes < 0).sum())
    if fill is not None and n_missing:
        read[fill] = read.get(fill, 0) + n_missing
    order = sorted(read, key=lambda v: (-read[v], v))
    kept = order[:max_categories]
    other = len(order) > len(kept)
    if encode == "ordinal":
        return Column(name, "categorical", impute, fill, "ordinal", sorted(kept), other=other, scale=rule["scale"])
    return Column(name, "categorical", impute, fill, "one_hot", kept, other=other, scale="none",
                  width=len(kept) + other)


@dataclass
class Preprocessor:
    """The fitted preprocessing of a model: its feature columns in the order they are read, and
    the rule for unseen categories. JSON form: :meth:`to_json` / :meth:`from_json`."""

    columns: list[Column]
    unseen: str = "other"

    @property
    def width(self) -> int:
        """Network inputs per row."""
        return sum(c.width for c in self.columns)

    @property
    def names(self) -> list[str]:
        """The feature columns, in the order they are read."""
        return [c.name for c in self.columns]

    @property
    def kinds(self) -> dict[str, str]:
        return {c.name: c.kind for c in self.columns}

    def nullable(self, name: str) -> bool:
        """Whether a missing value of column ``name`` is filled (so the scan may read NULLs)."""
        return next(c for c in self.columns if c.name == name).fill is not None

    @property
    def categorical(self) -> bool:
        return any(c.kind == "categorical" for c in self.columns)

    def scale_modes(self) -> list[str]:
        """The scaling of each network input (``width`` entries): see the module docstring."""
        return [c.scale for c in self.columns for _ in range(c.width)]

    def input_names(self) -> list[str]:
        return [n for c in self.columns for n in c.input_names()]

    @classmethod
    def numeric_only(cls, feature_names: list[str], width: int) -> "Preprocessor":
        """The preprocessing of a model stored without a record: every feature numeric (one
        array column when ``width`` exceeds the names), NULLs refused, standardised."""
        if len(feature_names) == 1 and width > 1:
            return cls([Column(feature_names[0], "array", width=width)])
        return cls([Column(n, "numeric") for n in feature_names])

    def to_json(self) -> dict:
        return {"columns": [asdict(c) for c in self.columns], "unseen": self.unseen}

    @classmethod
    def from_json(cls, obj: dict | None, feature_names: list[str], width: int) -> "Preprocessor":
        """The stored record (None: :meth:`numeric_only`). Raises InvalidArgument for a record
        that does not describe ``feature_names``."""
        if obj is None:
            return cls.numeric_only(feature_names, width)
        try:
            pre = cls([Column(**c) for c in obj["columns"]], obj.get("unseen", "other"))
        except (KeyError, TypeError) as exc:
            raise InvalidArgument(f"the model's preprocessing record is malformed ({exc!r}); train it again") from None
        if pre.names != list(feature_names) or any(c.kind not in KINDS for c in pre.columns):
            raise InvalidArgument("the model's preprocessing record does not match its feature columns; train it again")
        return pre

    def transform(self, raw: dict[str, np.ndarray], rows: np.ndarray | None = None,
                  finite: frozenset[str] = frozenset()) -> np.ndarray:
        """Raw columns -> network inputs (N, width) float32, before scaling; with ``rows`` (indices
        into the raw rows), the inputs of those rows only (N = len(rows)), as if the raw columns
        had been indexed by them first. ``finite`` names numeric columns the caller knows to hold
        no NaN (and no infinity): they are not tested again.

        ``raw[name]``: numeric (N,) float32 with NaN for missing; categorical :class:`Categories`
        (or a sequence of str or None); array (N, width) float32. Raises InvalidArgument naming the column for a
        missing value the model does not impute (with the count), and for an unseen category when
        ``unseen`` is ``error`` (with the value and the count)."""
        n = len(rows) if rows is not None else len(next(iter(raw.values()))) if raw else 0
        # A numeric column with nothing missing is read through ``rows`` (no copy of the column),
        # with the columns beside it in one row-major block (:mod:`.side_by_side`) as one; any other
        # is indexed first, so that its checks count its rows.
        numeric = [c.name for c in self.columns if c.kind == "numeric" and c.name not in finite]
        whole = dict(zip(numeric, side_by_side.finite([np.asarray(raw[name], np.float32) for name in numeric])))
        whole.update((name, True) for name in finite)
        sources: list[tuple[np.ndarray, bool]] = []     # per column: its inputs' source, read through rows?
        for c in self.columns:
            values = raw[c.name]
            if c.kind == "categorical":
                values = as_categories(values)
            if c.kind == "numeric" and whole[c.name]:
                sources.append((np.asarray(values, np.float32), rows is not None))
                continue
            if rows is not None:
                values = values[rows]
            if c.kind == "array":
                sources.append((np.asarray(values, np.float32).reshape(n, c.width), False))
                continue
            missing = np.isnan(values) if c.kind == "numeric" else values.codes < 0
            if missing.any() and c.fill is None:
                count = int(missing.sum())
                raise InvalidArgument(f'column "{c.name}" has {count:,} missing value{"s" if count > 1 else ""} '
                                      f"(NULL or NaN, of {n:,} rows) and the model does not impute it; filter them "
                                      "(predict_batch: options.skip_nulls), or train with an impute rule for the column")
            if c.kind == "numeric":
                sources.append((np.where(missing, np.float32(c.fill or 0), values) if missing.any() else values, False))
            else:
                sources.append((self._positions(c, values), False))
        out = np.empty((n, self.width), np.float32)
        blocks = self._blocks(sources)
        if len(blocks) == 1 and blocks[0][2].ndim == 2 and blocks[0][2].shape[1] == self.width and blocks[0][3]:
            np.take(blocks[0][2], rows, axis=0, out=out)          # one block of every input: one gather
            return out
        for start in range(0, n, TRANSFORM_BLOCK_ROWS):     # a block of rows stays in the cache over its columns
            block = slice(start, start + TRANSFORM_BLOCK_ROWS)
            self._write_block(out[block], [(j, c, source[rows[block]] if through else source[block])
                                           for j, c, source, through in blocks])
        return out

    def one_block(self, raw: dict[str, np.ndarray], finite: frozenset[str] = frozenset()) -> np.ndarray | None:
        """The network inputs of every row of ``raw`` as one (N, width) float32 C-contiguous
        block that ``raw``'s columns are views of, where there is one: every input a numeric
        column with nothing missing (``finite`` or tested here), the columns side by side in
        order (:mod:`.side_by_side`); else None. Where it is not None, ``transform(raw, rows,
        finite)`` is ``block[rows]``."""
        if not self.columns or any(c.kind != "numeric" for c in self.columns):
            return None
        values = [np.asarray(raw[c.name], np.float32) for c in self.columns]
        tested = [i for i, c in enumerate(self.columns) if c.name not in finite]
        if tested and not side_by_side.finite([values[i] for i in tested]).all():
            return None
        runs = side_by_side.runs(values)
        block = runs[0][2]
        if len(runs) != 1 or block.shape != (len(values[0]), self.width) or not block.flags.c_contiguous:
            return None
        return block

    def _blocks(self, sources: list[tuple[np.ndarray, bool]]) -> list[tuple[int, "Column", np.ndarray, bool]]:
        """``(first input, column, source, read through rows)`` of each column's source, where
        numeric columns side by side in one row-major block (and read alike) are one 2-D source
        (N, columns) of consecutive inputs, with the first of them as the column."""
        firsts = np.cumsum([0] + [c.width for c in self.columns]).tolist()
        out, i = [], 0
        while i < len(sources):
            stop = i + 1
            while (stop < len(sources) and self.columns[i].kind == self.columns[stop].kind == "numeric"
                   and sources[stop][0].ndim == sources[i][0].ndim == 1 and sources[stop][1] == sources[i][1]):
                stop += 1
            for start, end, block in side_by_side.runs([source for source, _ in sources[i:stop]]):
                source = block if end - start > 1 else sources[i + start][0]
                out.append((firsts[i + start], self.columns[i + start], source, sources[i][1]))
            i = stop
        return out

    def _write_block(self, out: np.ndarray, sources: list[tuple[int, "Column", np.ndarray]]) -> None:
        """Write one block of rows' inputs (B, width) float32 from each source's rows, at its
        first input: several numeric columns' values (B, columns), a numeric column's values
        (with the fill in place of missing ones), an array column's values, a categorical
        column's positions in its categories (:meth:`_positions`)."""
        for j, c, source in sources:
            if c.kind == "numeric" and source.ndim == 2:
                out[:, j:j + source.shape[1]] = source
            elif c.kind == "numeric":
                out[:, j] = source
            elif c.kind == "array":
                out[:, j:j + c.width] = source
            elif c.encode == "ordinal":
                out[:, j] = source + 1                                              # other: 0
            else:
                onehot = out[:, j:j + c.width]
                onehot[:] = 0.0
                rows = np.flatnonzero(source >= 0)
                onehot[rows, source[rows]] = 1.0
                if c.other:
                    onehot[source < 0, len(c.categories)] = 1.0

    def _positions(self, c: Column, values: Categories) -> np.ndarray:
        """(N,) int64: each row's index in ``c.categories``, -1 for other; a NULL is the fill's.
        Raises InvalidArgument for a value never seen in training when ``unseen`` is ``error``
        and the column has no "other" category."""
        lookup = {v: i for i, v in enumerate(c.categories)}
        by_code = np.array([lookup.get(v, -1) for v in values.values] + [lookup.get(c.fill, -1)], dtype=np.int64)
        index = by_code[values.codes]            # code -1 (a NULL) reads the last entry: the fill's index
        unseen = (index < 0) & (values.codes >= 0)
        if self.unseen == "error" and not c.other and unseen.any():
            first = values.values[int(values.codes[np.flatnonzero(unseen)[0]])]
            count = int(unseen.sum())
            raise InvalidArgument(f'column "{c.name}" has {count:,} value{"s" if count > 1 else ""} never seen in '
                                  f"training (the first: {shown(first)}); the model was trained with unseen "
                                  '"error": filter such rows, or train with options.unseen "other"')
        return index


def check_configured(configured, features: list[str]) -> None:
    """Raise InvalidArgument when ``configured`` (the columns options.preprocess names) holds one
    that is not among ``features``."""
    unknown = sorted(set(configured) - set(features))
    if unknown:
        raise InvalidArgument(f'options.preprocess names "{unknown[0]}", which is not a feature column; the feature '
                              f"columns are: {', '.join(features)}")


def fit(raw: dict[str, np.ndarray], kinds: dict[str, str], train_index: np.ndarray, opts,
        array_width: int | None = None) -> Preprocessor:
    """Fit the preprocessing of the columns ``kinds`` (name -> kind, in read order) on the rows
    ``train_index`` of ``raw`` (as :meth:`Preprocessor.transform` takes it) under the options
    ``opts`` (:class:`.model.TrainOptions`). Raises InvalidArgument for a rule that does not suit
    its column (mean of a categorical column, a string constant for a numeric one), a column
    option naming no feature column, and a column with nothing to impute from."""
    check_configured(opts.preprocess or {}, list(kinds))
    columns = []
    for name, kind in kinds.items():
        rule = _rule(opts, name)
        if kind == "array":
            columns.append(Column(name, "array", scale=rule["scale"], width=int(array_width)))
        elif kind == "numeric":
            if name in (opts.preprocess or {}) and "encode" in opts.preprocess[name]:
                raise InvalidArgument(f'options.preprocess."{name}".encode: column "{name}" is numeric; encode '
                                      "applies to categorical (text, enum, boolean) columns")
            columns.append(_fit_numeric(name, lambda name=name: raw[name][train_index].astype(np.float32), rule))
        else:
            if rule["impute"] in ("mean", "median") and "impute" not in (opts.preprocess or {}).get(name, {}):
                rule["impute"] = "mode"        # the call-wide default: a category's stand-in for a mean
            columns.append(_fit_categorical(name, as_categories(raw[name])[train_index], rule, opts.max_categories))
    return Preprocessor(columns, opts.unseen)


#: rows of a block of :meth:`Preprocessor.transform`'s output written column by column
TRANSFORM_BLOCK_ROWS = 16384
#: rows of a block of :func:`fit_scaling`'s sums: a float64 copy of one block stays in the cache
SCALING_BLOCK_ROWS = 32768


def fit_scaling(x: np.ndarray, modes: list[str], rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The affine scaling of inputs x (N, F) float32 by column ``modes`` (:data:`SCALES`):
    ``(center, spread)``, each (F,) float32, so that the network reads ``(x - center) / spread``;
    fitted on ``x[rows]`` where ``rows`` ((M,) integer indices) is given, the same bits as on a
    gathered copy of them. A constant column gets spread 1. The mean and the population standard
    deviation are computed in float64 in one pass, from the sums of each value's difference to a
    shift (the mean of the first block of rows) and of its square (:func:`_shifted_moments`); the
    minimum and maximum exactly on ``x``."""
    center, spread = np.zeros(x.shape[1]), np.ones(x.shape[1])
    modes = np.asarray(modes)
    n = len(x) if rows is None else len(rows)
    std = modes == "standardize"
    if std.any() and n:
        first = x[:SCALING_BLOCK_ROWS] if rows is None else np.take(x, rows[:SCALING_BLOCK_ROWS], axis=0)
        shift = first.mean(axis=0, dtype=np.float64)
        s1, s2 = _shifted_moments(x, shift, rows)
        offset = s1 / n                           # the mean's difference to the shift
        mean, variance = shift + offset, np.maximum(s2 / n - offset * offset, 0.0)
        center[std], spread[std] = mean[std], np.sqrt(variance[std])
    mm = modes == "minmax"
    if mm.any() and n:
        of = x[:, mm] if rows is None else np.take(x[:, mm], rows, axis=0)
        low = of.min(axis=0).astype(np.float64)
        center[mm], spread[mm] = low, of.max(axis=0) - low
    spread[spread == 0] = 1.0
    return center.astype(np.float32), spread.astype(np.float32)


def _shifted_moments(x: np.ndarray, shift: np.ndarray, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per column of x (N, F) (of ``x[rows]``, in the order of ``rows``, where given), the sums
    of ``x - shift`` and of its squares, (F,) float64 each:
    by the runtime's C loop (:func:`.fused.moments`; 800,000 rows of 16 columns: 0.007 s, where
    NumPy's two passes over float64 blocks took 0.06 to 0.07 s, medians of 5), else block by block (each
    block's float64 differences stay in the cache). With the shift near the mean, the variance
    ``s2 / N - (s1 / N)^2`` loses no more than the shift's distance to the mean in standard
    deviations (squared) of float64's 16 digits."""
    from . import fused  # the coordinator's: a backend never fits a scaling

    sums = fused.moments(x, shift, rows)
    if sums is not None:
        return sums
    s1, s2 = np.zeros(x.shape[1]), np.zeros(x.shape[1])
    for start in range(0, len(x) if rows is None else len(rows), SCALING_BLOCK_ROWS):
        block = slice(start, start + SCALING_BLOCK_ROWS)
        d = np.subtract(x[block] if rows is None else np.take(x, rows[block], axis=0), shift, dtype=np.float64)
        s1 += d.sum(axis=0)
        s2 += np.einsum("ij,ij->j", d, d)
    return s1, s2
