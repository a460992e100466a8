# Installs the libraries, public headers, the rdep command and a CMake package config so a user can
#   find_package(rdep REQUIRED)  target_link_libraries(app PRIVATE rdep::rdep)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

add_library(rdep_all INTERFACE)
set_target_properties(rdep_all PROPERTIES EXPORT_NAME rdep)
target_link_libraries(rdep_all INTERFACE ${RDEP_EXPORTED_TARGETS})
add_library(rdep::rdep ALIAS rdep_all)

install(TARGETS ${RDEP_EXPORTED_TARGETS} rdep_all EXPORT rdepTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY include/rdep DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT rdepTargets NAMESPACE rdep:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/rdep)
configure_package_config_file(cmake/rdepConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/rdepConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/rdep)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/rdepConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/rdepConfig.cmake ${CMAKE_CURRENT_BINARY_DIR}/rdepConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/rdep)
