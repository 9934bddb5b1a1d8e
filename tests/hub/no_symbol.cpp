// A shared library that is not a kcpp package: it exports a function, but not kcpp_package_v1.
extern "C" __attribute__((visibility("default"))) int kcpp_not_a_package(void) { return 42; }
