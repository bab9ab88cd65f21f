#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <omp.h>
#include <immintrin.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int c, char**v){
  size_t n=(size_t)atol(v[1])/4; int reps=atoi(v[2]); size_t chunk=atol(v[3])/4; int thr=atoi(v[4]);
  float*a=aligned_alloc(64,n*4); for(size_t i=0;i<n;i++)a[i]=i&7;
  size_t nc = n/chunk; size_t*ord=malloc(nc*sizeof(size_t)); for(size_t i=0;i<nc;i++)ord[i]=i;
  srand(2); for(size_t i=nc-1;i>0;i--){size_t j=rand()%(i+1);size_t t=ord[i];ord[i]=ord[j];ord[j]=t;}
  double best=1e9; float tot=0;
  for(int r=0;r<reps;r++){double t=now();
    #pragma omp parallel num_threads(thr) reduction(+:tot)
    { __m256 s0=_mm256_setzero_ps(),s1=s0,s2=s0,s3=s0; int id=omp_get_thread_num();
      for(size_t b=id*nc/thr;b<(id+1)*nc/thr;b++){float*p=a+ord[b]*chunk; for(size_t i=0;i<chunk;i+=32){s0=_mm256_add_ps(s0,_mm256_load_ps(p+i));s1=_mm256_add_ps(s1,_mm256_load_ps(p+i+8));s2=_mm256_add_ps(s2,_mm256_load_ps(p+i+16));s3=_mm256_add_ps(s3,_mm256_load_ps(p+i+24));}}
      float o[8]; _mm256_storeu_ps(o,_mm256_add_ps(_mm256_add_ps(s0,s1),_mm256_add_ps(s2,s3))); tot+=o[0]; }
    t=now()-t; if(t<best)best=t;}
  printf("%zu MB chunk %zu thr %d: %.1f GB/s (%g)\n", n*4>>20, chunk*4, thr, n*4/best/1e9, tot);
}
