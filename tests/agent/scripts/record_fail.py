"""A worker that fails inside torch's @record, so torch writes TORCHELASTIC_ERROR_FILE."""

import sys

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    print("about to fail", file=sys.stderr, flush=True)
    raise ValueError("loss is nan at step 42")


if __name__ == "__main__":
    main()
