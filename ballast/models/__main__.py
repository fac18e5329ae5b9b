"""`python -m ballast.models --out DIR [--preset tiny] [--seed 0]`: build a random-init tiny model offline.

(Running `-m ballast.models.tiny` would execute that module a second time after the package import,
which Python warns about.)"""

from ballast.models import main

if __name__ == "__main__":
    raise SystemExit(main())
