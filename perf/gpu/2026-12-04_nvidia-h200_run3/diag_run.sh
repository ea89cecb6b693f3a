export SKBUILD_CMAKE_DEFINE="ULTRACOMM_CUDA_ARCHITECTURES=90-real" PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
echo "built in ${SECONDS}s"
D=$OUT/diag.txt
echo "=== hostword" | tee -a $D; timeout -s KILL 25 python3 diag/hostword.py 2>&1 | tee -a $D | tail -12
run() { echo "=== $*" | tee -a $D; timeout -s KILL 14 env "$@" >> $D 2>&1; echo "rc=$? at ${SECONDS}s" | tee -a $D; }
run DIAG_STREAM=default python3 diag/trace.py tests/mp/copy_engine_failure_worker.py stalled
run DIAG_STREAM=side python3 diag/trace.py tests/mp/copy_engine_failure_worker.py stalled
run DIAG_STREAM=default python3 diag/trace.py tests/mp/copy_engine_failure_worker.py mismatch
run DIAG_STREAM=default python3 diag/trace.py tests/mp/split_cuda_stall_worker.py
grep -v "^  File\|^Current\|^$" $D | grep -v "^Thread" | cut -c1-400 | head -60
timeout -s INT -k 5 100 python3 -m pytest tests -m gpu -q -p no:cacheprovider --timeout=50 -o faulthandler_timeout=45 \
  --deselect tests/test_copy_engine_gpu.py::test_stalled_rank_times_out_and_releases_the_callers_stream \
  --deselect tests/test_copy_engine_gpu.py::test_peer_on_another_plan_is_a_plan_error_and_receives_nothing \
  --deselect tests/test_split_cuda_gpu.py::test_a_stalled_cross_domain_rank_is_a_named_timeout_and_the_callers_stream_is_released \
  -rA > $OUT/gpu-tests.log 2>&1; echo "pytest rc=$? at ${SECONDS}s"
grep -E "^(PASSED|FAILED|ERROR)" $OUT/gpu-tests.log | cut -c1-200 | grep -v ^PASSED; tail -2 $OUT/gpu-tests.log
timeout -s INT -k 5 45 python3 perf/bench_gpu.py --out $OUT --budget-s 30 > $OUT/bench_gpu.txt 2> $OUT/bench_gpu.log; echo "bench rc=$? at ${SECONDS}s"
grep -E "tile mover|goal|#wrong total" $OUT/bench_gpu.txt | grep -E "reduce|k=|goal|#wrong|stream" | head -30
