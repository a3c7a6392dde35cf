"""``python -m fairseq_megatron.user_dir`` prints the path for fairseq's ``--user-dir``."""

import os

if __name__ == "__main__":
    print(os.path.dirname(os.path.abspath(__file__)))
