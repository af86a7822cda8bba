"""The pass/fail bookkeeping the client scripts share: each check prints
'ok NAME', and the first failure prints why and exits non-zero; the last
line is always 'N passed, M failed', which the Rust side reads."""
import sys

passed = 0


def check(name, cond, detail=""):
    """Records one check; exits with status 1 on the first failure."""
    global passed
    if not cond:
        print(f"FAIL {name}: {detail}")
        print(f"{passed} passed, 1 failed")
        sys.exit(1)
    passed += 1
    print(f"ok {name}")


def summary(extra=""):
    """The final line."""
    print(f"{passed} passed, 0 failed{extra}")
