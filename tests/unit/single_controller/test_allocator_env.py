"""CPU workers start with glibc malloc told to keep freed memory; GPU workers and malloc settings
the user made in the driver's environment are left alone."""

from ballast.single_controller.worker_group import CPU_MALLOC_ENV, allocator_env


def test_cpu_pools_get_the_malloc_settings_and_the_users_own_win():
    assert allocator_env(use_gpu=False, environ={}) == CPU_MALLOC_ENV
    assert set(CPU_MALLOC_ENV) == {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"}
    assert allocator_env(use_gpu=True, environ={}) == {}
    mine = {"MALLOC_TRIM_THRESHOLD_": "0"}
    got = allocator_env(use_gpu=False, environ=mine)
    assert set(got) == set(CPU_MALLOC_ENV) - set(mine)
