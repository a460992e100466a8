# rdep_library(NAME SRCS ... [CUDA_SRCS ...] DEPS ...): one component library, installed and exported.
# rdep_test(NAME SRCS ... DEPS ...): a GoogleTest binary registered with CTest.
set(RDEP_WARNINGS -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion)
# GCC 12 warns -Wrestrict inside libstdc++ for `"literal" + std::string&&` at -O2 (GCC bug 105651, a
# false positive fixed in GCC 13): silenced for that compiler only.
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12 AND
   CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
  list(APPEND RDEP_WARNINGS -Wno-restrict)
endif()
set(RDEP_EXPORTED_TARGETS "" CACHE INTERNAL "")

function(rdep_set_options target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:${RDEP_WARNINGS}>
    $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo -Xptxas=-warn-spills,-warn-lmem-usage --expt-relaxed-constexpr -Xcompiler=-Wall,-Wextra>)
  if(RDEP_DEBUG_SYNC)
    target_compile_definitions(${target} PRIVATE RDEP_DEBUG_SYNC=1)
  endif()
  if(RDEP_HAVE_CUDA AND RDEP_PDL_ARCHS)
    target_compile_definitions(${target} PRIVATE RDEP_PDL_ARCHS=1)
  endif()
endfunction()

function(rdep_library name)
  cmake_parse_arguments(A "" "" "SRCS;CUDA_SRCS;DEPS;PRIVATE_DEPS" ${ARGN})
  set(srcs ${A_SRCS})
  if(RDEP_HAVE_CUDA)
    list(APPEND srcs ${A_CUDA_SRCS})
  endif()
  if(NOT srcs)  # header-only in this build (e.g. the dispatch layer without CUDA)
    add_library(rdep_${name} INTERFACE)
    add_library(rdep::${name} ALIAS rdep_${name})
    set_target_properties(rdep_${name} PROPERTIES EXPORT_NAME ${name})
    target_include_directories(rdep_${name} INTERFACE
      $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
      $<INSTALL_INTERFACE:include>)
    target_link_libraries(rdep_${name} INTERFACE ${A_DEPS})
    if(RDEP_HAVE_CUDA)
      target_compile_definitions(rdep_${name} INTERFACE RDEP_HAVE_CUDA=1)
    endif()
    set(RDEP_EXPORTED_TARGETS ${RDEP_EXPORTED_TARGETS} rdep_${name} CACHE INTERNAL "")
    return()
  endif()
  add_library(rdep_${name} ${srcs})
  add_library(rdep::${name} ALIAS rdep_${name})
  set_target_properties(rdep_${name} PROPERTIES EXPORT_NAME ${name} CUDA_SEPARABLE_COMPILATION OFF)
  # include/ is the public interface; src/ (internal headers) is for the library's own sources.
  target_include_directories(rdep_${name}
    PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include> $<INSTALL_INTERFACE:include>
    PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(rdep_${name} PUBLIC ${A_DEPS} PRIVATE ${A_PRIVATE_DEPS})
  if(RDEP_HAVE_CUDA)
    target_compile_definitions(rdep_${name} PUBLIC RDEP_HAVE_CUDA=1)
  endif()
  rdep_set_options(rdep_${name})
  set(RDEP_EXPORTED_TARGETS ${RDEP_EXPORTED_TARGETS} rdep_${name} CACHE INTERNAL "")
endfunction()

function(rdep_test name)
  if(NOT RDEP_BUILD_TESTS)
    return()
  endif()
  cmake_parse_arguments(A "" "" "SRCS;DEPS" ${ARGN})
  add_executable(${name} ${A_SRCS})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/src)  # tests may use internal headers
  target_link_libraries(${name} PRIVATE ${A_DEPS} GTest::gtest GTest::gtest_main Threads::Threads)
  rdep_set_options(${name})
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60 PROPERTIES TIMEOUT 600)
endfunction()

include(GoogleTest)
