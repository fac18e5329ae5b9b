"""The data protocol between the driver and the workers: `Batch` and its canonical fields.

Imports only torch, tensordict and numpy (never ray), so workers, tests and the engine-side code
can use it anywhere.
"""

from ballast.protocol.batch import PAD_COUNT_KEY, Batch
from ballast.protocol.fields import FIELDS, FieldSpec, check_fields
from ballast.protocol.output import Output
from ballast.protocol.padding import concat_padded, pad_to_widths

__all__ = ["Batch", "FIELDS", "FieldSpec", "Output", "PAD_COUNT_KEY", "check_fields", "concat_padded",
           "pad_to_widths"]
