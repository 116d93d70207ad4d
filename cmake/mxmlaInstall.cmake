# mxmla — install rules and the exported CMake package (included at the end of CMakeLists.txt).
#
#   cmake --install <build> --prefix <prefix>
# installs, besides the command-line tool (bin/mxmla, component "cli"), component "dev":
#   include/mxmla/*.h                              the public headers
#   lib/libmxmla.a                                 the library (CPU reference + CUDA kernels when built)
#   lib/cmake/mxmla/mxmlaConfig.cmake, mxmlaConfigVersion.cmake, mxmlaTargets*.cmake
# so that a C++ project can find_package(mxmla) and link mxmla::mxmla. The Python wheel installs
# only component "python" (pyproject.toml: install.components).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

add_library(mxmla::mxmla ALIAS mxmla)  # the same name for add_subdirectory() users

set(MXMLA_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/mxmla" CACHE STRING "Where mxmlaConfig.cmake is installed")

install(TARGETS mxmla EXPORT mxmlaTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev)
install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/include/mxmla DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT dev
        FILES_MATCHING PATTERN "*.h")
install(EXPORT mxmlaTargets NAMESPACE mxmla:: DESTINATION ${MXMLA_INSTALL_CMAKEDIR} COMPONENT dev)

configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/mxmlaConfig.cmake.in
                              ${CMAKE_CURRENT_BINARY_DIR}/mxmlaConfig.cmake
                              INSTALL_DESTINATION ${MXMLA_INSTALL_CMAKEDIR})
# 0.x: a minor version may change the API, so only the same major.minor is compatible.
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/mxmlaConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/mxmlaConfig.cmake ${CMAKE_CURRENT_BINARY_DIR}/mxmlaConfigVersion.cmake
        DESTINATION ${MXMLA_INSTALL_CMAKEDIR} COMPONENT dev)
