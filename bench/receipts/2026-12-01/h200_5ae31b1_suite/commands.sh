CTEST_TIMEOUT=120 PYTEST_ARGS="--durations 25" RDEP_COMMIT=5ae31b1 bash scripts/device.sh --budget 575   # nvidia-h200, carry .whl shared/baselines
