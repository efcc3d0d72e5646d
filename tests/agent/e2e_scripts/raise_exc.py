"""raise_exc.py [--record]: raise ValueError with a known message, with or without torch's
@record (which writes TORCHELASTIC_ERROR_FILE)."""

import sys

if "--record" in sys.argv[1:]:
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        raise ValueError("e2e-boom-with-record")
else:

    def main():
        raise ValueError("e2e-boom-without-record")


if __name__ == "__main__":
    main()
